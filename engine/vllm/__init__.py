"""The vLLM backend: managed or attached OpenAI-compatible servers, talked to with httpx."""
