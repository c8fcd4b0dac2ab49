"""What the micro-benchmarks share: a warm context of code and English, and timing configurations in turns."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Hashable

from engine.exact.forward import forward, new_cache, rollback


def code_context(tokenizer, n: int) -> list[int]:
    """The first n tokens of engine/exact/proposers.py (code, comments and English docstrings)."""
    source = (Path(__file__).resolve().parent.parent / "engine" / "exact" / "proposers.py").read_text()
    return tokenizer(source, add_special_tokens=False)["input_ids"][:n]


def timed(fn) -> float:
    """ms that fn() took."""
    t = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - t)


def forward_ms_in_turns(model, context: list[int], configs: dict[Hashable, Callable], rounds: int,
                        warmup: int) -> dict[Hashable, list[float]]:
    """ms of each timed forward pass, per configuration: `configs[key](cache)` runs one pass after `context`, and
    the cache is cropped back to `context` after it, untimed. The configurations take turns round by round, so that
    a drift in the machine's speed favours none; the first `warmup` rounds pay one-off costs and are not kept."""
    cache = new_cache(model)
    forward(model, context, cache, keep=1)
    times: dict[Hashable, list[float]] = {key: [] for key in configs}
    for i in range(warmup + rounds):
        for key, one_pass in configs.items():
            t = time.perf_counter()
            one_pass(cache)
            if i >= warmup:
                times[key].append(1000 * (time.perf_counter() - t))
            rollback(cache, len(context))
    return times
