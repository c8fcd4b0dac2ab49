"""What the server backends (vLLM, llama.cpp) share: one streamed request and ServerError, the guarded process,
its environment, caps on what a server sends, and its /metrics counters beside a run's count. It imports neither
backend."""
