"""The process-wide settings the console needs, made by one explicit call from each entry point (launch.py, the app
builder, the benchmarks, tests/conftest.py) rather than as a side effect of importing a module."""

from __future__ import annotations

import logging
import warnings


def setup() -> None:
    """Make the settings; idempotent (each one replaces itself or is made once). Imports torch and transformers."""
    from engine.serving.http_safety import RedactURLs

    # Set once for the process, not with catch_warnings around each call: that is not thread-safe, and the draft
    # loads beside the target. torch marks its quantized tensors deprecated; they are what its int8 Linears run on.
    warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
    # torch warns on tensors over read-only arrays (a mapped GGUF file, engine.loading.gguf_dequant): ours are only read.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    # httpx logs every request's URL at INFO: its credentials must not reach the console's log
    httpx_log = logging.getLogger("httpx")
    if not any(isinstance(f, RedactURLs) for f in httpx_log.filters):
        httpx_log.addFilter(RedactURLs())
