"""What the micro-benchmarks share: a warm context of code and English, timing configurations in turns, and which
code of the int8 kernel they time."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Hashable

from engine.exact import decoder
from engine.exact.forward import forward, new_cache, rollback
from engine.exact.grouped_int8 import GroupedInt8Linear


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


def add_avx2_option(parser) -> None:
    parser.add_argument("--avx2", action="store_true",
                        help="run the kernel's AVX2 code where the CPU has AVX-512 VNNI (what an AVX2 machine runs)")


def kernel_code(models, avx2: bool) -> str:
    """Which code of the int8 kernel the models' Linears run, for a table's heading: "VNNI" or "AVX2". With `avx2`
    they run the AVX2 code (--avx2), "AVX2 (on a CPU with VNNI)" where the CPU has VNNI."""
    layers = [m for model in models for m in model.modules() if isinstance(m, GroupedInt8Linear)]
    kernel = "VNNI" if any(layer.vnni for layer in layers) else "AVX2"
    if avx2:
        for layer in layers:
            layer.vnni = False
        for model in models:
            decoder.forget(model)  # its layers in C++ hold the flags
        kernel = "AVX2" + (" (on a CPU with VNNI)" if kernel == "VNNI" else "")
    return kernel
