"""The llama.cpp backend: managed engines (llama-server built here for this CPU, a user's own, or the xllamacpp
wheel), or llama-server instances attached by URL."""
