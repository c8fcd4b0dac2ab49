"""The llama.cpp backend: xllamacpp engines in process, or llama-server instances attached by URL."""
