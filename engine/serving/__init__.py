"""What the server backends (vLLM, llama.cpp) share: one streamed request and ServerError, the guarded process,
its environment, and caps on what a server sends. It imports neither backend."""
