"""Where the console keeps what it builds or downloads once: weights, converted models, kernels, calibrations,
llama-server builds. $SPECCONSOLE_CACHE, else ~/.cache/specconsole."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("SPECCONSOLE_CACHE", Path.home() / ".cache" / "specconsole"))
