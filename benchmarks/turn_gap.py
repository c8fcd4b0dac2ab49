"""Idle gaps between fair-mode turns, without a page: does waiting before a timed pass change what it measures?

    python -m benchmarks.turn_gap                                   # gaps of 0 and 100 ms, 2 engines, 5 runs each
    python -m benchmarks.turn_gap --compare "n-gram,n-gram K=2 fixed,draft K=4 fixed"   # 5 engines
    python -m benchmarks.turn_gap --gaps-ms 0 100 --warm-ms 20      # and a 20 ms untimed busy loop after each gap
    python -m benchmarks.turn_gap --precision float16

In the page, each fair-mode turn waits for the page to hand its last update over and for the browser to draw it
(specconsole.run_stream.hand_over), so the engines' passes follow idle gaps of tens to hundreds of ms; through the API
they follow each other at once. This runs the same comparison through the API (specconsole.runner.Comparison, fair
mode, no page) with an untimed sleep of each --gaps-ms before every turn, standing in for the page's wait (where the
clocks are stopped), the gaps taking turns run by run. Prints per gap the medians of the engines' tok/s and of the
per-run speedup, and their ratios to the first gap's. Nothing here is a test; on a noisy machine, use more runs.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch

from benchmarks.doc_table import machine
from benchmarks.page import PROMPT
from engine.exact.backend import LocalBackend
from engine.exact.precision import PRECISIONS
from engine.presets import PRESETS
from engine.request import build_request
from engine.setup import setup
from specconsole.runner import Comparison
from specconsole.variants import from_presets

log = logging.getLogger("benchmarks.turn_gap")


class Gap:
    """Stands in for Comparison.page_idle: each turn's wait for the page becomes a sleep of `s`, then `warm`
    seconds of untimed matrix products on the engines' threads (does waking the cores first undo the gap?)."""

    def __init__(self, s: float, warm: float = 0.0):
        self.s, self.warm = s, warm
        self.work = torch.randn(256, 256)
        self.waits = 0

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        time.sleep(self.s)
        end = time.perf_counter() + self.warm
        while time.perf_counter() < end:
            self.work @ self.work
        return True

    def is_set(self) -> bool:
        return False  # a page always drawing: every turn waits (then for a quiet machine, as after the page)

    def set(self) -> None:
        pass

    def clear(self) -> None:
        pass


def run(backend, req, extra, gap: Gap | None) -> dict:
    """One fair-mode comparison through the API, with `gap` before each turn -> each engine's RunResult."""
    comp = Comparison(backend, req, "fair", None, {}, extra=extra)
    if gap is not None:
        comp.page_idle = gap
    comp.start()
    while not comp.poll(0.2):
        pass
    return comp.results


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    setup()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="qwen-coder", choices=list(PRESETS))
    p.add_argument("--precision", default="float32", choices=PRECISIONS)
    p.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 100], help="untimed idle before each turn")
    p.add_argument("--warm-ms", type=float, default=0, help="untimed busy loop after each gap above 0")
    p.add_argument("--runs", type=int, default=5, help="runs per gap, after one warm-up run")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--compare", default="", help="an N-way run: the page's \"Compare with\" presets, comma-separated")
    args = p.parse_args(argv)

    backend = LocalBackend.from_preset(args.preset, precision=args.precision)
    req = build_request(PROMPT, max_new_tokens=args.max_new_tokens, method=PRESETS[args.preset].method)
    extra = from_presets(req, [n.strip() for n in args.compare.split(",") if n.strip()])
    gaps = {ms: Gap(ms / 1000, args.warm_ms / 1000) if ms else None for ms in args.gaps_ms}
    run(backend, req, extra, None)  # warm-up
    rows: dict[float, list[dict]] = {ms: [] for ms in gaps}
    for i in range(args.runs):
        for ms in list(gaps) if i % 2 == 0 else list(gaps)[::-1]:
            tps = {e: r.metrics.tokens_per_s for e, r in run(backend, req, extra, gaps[ms]).items()}
            rows[ms].append(tps | {"speedup": tps["speculative"] / tps["baseline"]})
            log.info("run %d, gap %g ms: %s", i + 1, ms, {k: round(v, 2) for k, v in rows[ms][-1].items()})

    med = {ms: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for ms, rs in rows.items()}
    first = med[args.gaps_ms[0]]
    keys = list(first)
    out = sys.stdout
    warm = f", then {args.warm_ms:g} ms busy" if args.warm_ms else ""
    out.write(f"\nturn gaps: {backend.target.name}, preset {args.preset}, {len(keys) - 1} engines, "
              f"{args.max_new_tokens} new tokens, greedy, fair mode through the API; an untimed sleep before each "
              f"turn{warm}; medians of {args.runs} runs per gap (ratios: to the {args.gaps_ms[0]:g} ms gap); "
              f"machine: {machine()}; {time.strftime('%Y-%m-%d %H:%M')}\n\n")
    out.write("| gap (ms) | " + " | ".join(keys) + " |\n|" + " --- |" * (len(keys) + 1) + "\n")
    for ms, m in med.items():
        cells = [f"{m[k]:.2f}" + ("" if ms == args.gaps_ms[0] else f" ({m[k] / first[k]:.2f})") for k in keys]
        out.write(f"| {ms:g} | " + " | ".join(cells) + " |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
