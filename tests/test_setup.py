"""Importing the engine changes nothing process-wide; engine.setup.setup() makes the settings the entry points need
(warning filters, the httpx log filter that redacts URLs), once however often it is called. The engine is a library
without it: a backend registers what its models need as it builds them (the rowwise attention)."""

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
    assert after_setup == {"ours_ignored": [1, 1], "httpx_filters": 1, "rowwise": False}


# in a fresh interpreter, without setup(): a LocalBackend on a tiny target, as a library user would build one
LIBRARY = """
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from engine.exact.backend import LocalBackend
from engine.exact.models import LoadedModel
from engine.exact.optimize import prepare_target
from engine.loading.weights import dequantized_dir
from engine.request import Request

tokenizer = AutoTokenizer.from_pretrained(dequantized_dir("smollm2-135m-instruct"))
torch.manual_seed(0)
config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None)
target = prepare_target(LlamaForCausalLM(config).eval(), torch.device("cpu"))
backend = LocalBackend(LoadedModel("tiny", target, tokenizer, torch.device("cpu")), None)
result = list(backend.baseline(Request(prompt="Hello", max_new_tokens=4)))[-1]
print(result.error, len(result.tokens))
"""


def test_the_engine_runs_as_a_library_without_setup():
    done = subprocess.run([sys.executable, "-c", LIBRARY], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["None", "4"]
