"""Shared fixtures: tiny models built from a config (fast, for the logic) and the real SmolLM2 weights."""

from __future__ import annotations

import copy
import socket
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.optimize import prepare_draft, prepare_target
from engine.weights import dequantized_dir

CPU = torch.device("cpu")


def tiny_llama(vocab: int, seed: int, layers: int = 2, init: float = 0.3, kv_heads: int = 2) -> LlamaForCausalLM:
    """A random Llama small enough to run thousands of steps a second; a large init makes its distributions peaky,
    so that greedy choices are clear and sampled ones are far from uniform."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=256, initializer_range=init, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def perturbed(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A draft that agrees with the target often but not always."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * scale * p.std())
    return draft


@pytest.fixture(scope="session")
def smol_dir():
    return dequantized_dir("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def tiny_pair():
    """(target, draft) with a 512-token vocabulary: exact target kernels, a draft that is right about half the time."""
    target = tiny_llama(512, seed=1)
    draft = perturbed(target, 0.6, seed=2)
    return prepare_target(target, CPU), prepare_draft(draft, CPU, int8=False)


@pytest.fixture(scope="session")
def tiny_chat_pair(smol_tokenizer):
    """Like tiny_pair, but with SmolLM2's full vocabulary, so that real prompts (chat template included) encode."""
    target = tiny_llama(len(smol_tokenizer), seed=3)
    draft = perturbed(target, 0.6, seed=4)
    return prepare_target(target, CPU), prepare_draft(draft, CPU, int8=False)


@pytest.fixture(scope="module")
def backend(tiny_chat_pair, smol_tokenizer):
    """A LocalBackend over tiny_chat_pair (one per test module: it remembers the measured target step)."""
    from engine.local_backend import LocalBackend
    from engine.models import LoadedModel

    target, draft = tiny_chat_pair
    return LocalBackend(LoadedModel("tiny", target, smol_tokenizer, CPU), LoadedModel("tiny-draft", draft, smol_tokenizer, CPU))


def free_ports(n: int) -> list[int]:
    """n distinct ports on 127.0.0.1 that were free a moment ago (all held open together, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_to_end(comp):
    """Start a specconsole.runner.Comparison and poll it until both engines finished (about 150 s at most)."""
    comp.start()
    for _ in range(3000):
        if comp.poll(timeout=0.05):
            return comp
    raise AssertionError("the comparison did not finish")


CHROMIUM = "/usr/bin/chromium"  # Debian's (never `playwright install`)


def launch_chromium(pw):
    """Debian's Chromium, headless, with nothing of its own running in the background."""
    return pw.chromium.launch(
        executable_path=CHROMIUM, headless=True,
        args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
              "--disable-component-update", "--disable-sync"],
    )


def set_run(page, prompt: str, max_new: int) -> None:
    """Type a prompt into the console, greedy, with `max_new` new tokens."""
    page.fill("#prompt textarea", prompt)
    for selector, value in (("#temperature", "0"), ("#max-new", str(max_new))):
        box = page.locator(f"{selector} input[type=number]")
        box.fill(value)
        box.press("Enter")
