"""Importing the engine changes nothing process-wide; engine.setup.setup() makes the settings the entry points need
(warning filters, the httpx log filter that redacts URLs, the rowwise attention), once however often it is called."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("quantized tensor creation functions", "The given NumPy array is not writable")

# in a fresh interpreter: every engine module imported, then the process-wide state before and after setup() twice
STATE = """
import importlib, json, logging, pkgutil, sys, warnings
import engine
from transformers import AttentionInterface

def state():
    ignored = [f[1].pattern for f in warnings.filters if f[0] == "ignore" and f[1] is not None]
    return {"ours_ignored": [sum(m in p for p in ignored) for m in sys.argv[1:]],
            "httpx_filters": len(logging.getLogger("httpx").filters),
            "rowwise": "rowwise" in AttentionInterface()}

for m in pkgutil.walk_packages(engine.__path__, "engine."):
    if m.name != "engine.setup":
        importlib.import_module(m.name)
imported = state()
from engine.setup import setup
setup()
setup()
print(json.dumps([imported, state()]))
"""


def test_importing_changes_nothing_and_setup_makes_each_setting_once():
    done = subprocess.run([sys.executable, "-c", STATE, *OURS], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    imported, after_setup = json.loads(done.stdout)
    assert imported == {"ours_ignored": [0, 0], "httpx_filters": 0, "rowwise": False}
    assert after_setup == {"ours_ignored": [1, 1], "httpx_filters": 1, "rowwise": True}
