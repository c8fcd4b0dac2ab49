"""The HTTP backends and the presets and prompt formatting they use import without torch: a console that only talks
to vLLM or llama.cpp servers does not pay for torch (seconds of start, hundreds of MB)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HTTP_BACKENDS = sorted(f"engine.{package}.{p.stem}" for package in ("vllm", "llamacpp", "serving")
                       for p in (ROOT / "engine" / package).glob("*.py") if p.stem != "__init__")
TORCH_FREE = (*HTTP_BACKENDS, "engine.presets", "engine.prompts", "engine.request", "engine.sampling_params",
              "engine.cache")

# imports each module in turn in a fresh interpreter and prints the first one after which torch is loaded
FIRST_WITH_TORCH = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
    if "torch" in sys.modules:
        print(name)
        break
"""


def test_http_backends_and_prompt_formatting_do_not_import_torch():
    assert len(HTTP_BACKENDS) >= 8  # the glob found the backends' modules
    done = subprocess.run([sys.executable, "-c", FIRST_WITH_TORCH, *TORCH_FREE], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", f"importing {done.stdout.strip()} imports torch"
