"""Padded vs unpadded target passes, end to end: the baseline and our speculative engine, each with the target's
short passes padded to engine.exact.optimize.MIN_ROWS rows and not padded, side by side in one process.

    python -m benchmarks.padding                        16 MT-Bench prompts (2 per category), sample seed 0
    python -m benchmarks.padding --mtbench-prompts 8 --humaneval-prompts 8

Why: on our 2-core CPU oneDNN's kernels for 1-4 rows are slower than for 5, so padding makes a plain decoding step
(one row) cheaper. A speedup measured against an unpadded baseline then credits speculative decoding with what is
really a slow kernel in the baseline. Per prompt the four runs (baseline and speculative, padded and not) take
turns, their order reversed on every other prompt; each padding keeps its own learned step costs, as a process
loaded with that padding would. Greedy, the default preset and the page's default settings. Prints tok/s per run
and the ratios, the median over prompts with a 95 % bootstrap interval.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from tqdm import tqdm

from benchmarks.doc_table import machine
from benchmarks.speed import add_sample_args, describe_prompts, run_engine, sample_plan, with_ci
from engine.exact import calibration
from engine.exact.backend import LocalBackend
from engine.exact.optimize import MIN_ROWS, PackedLinear
from engine.presets import DEFAULT_PRESET, PRESETS
from engine.request import build_request
from engine.setup import setup

log = logging.getLogger("benchmarks.padding")

ENGINES = ("baseline", "speculative")


class Paddings:
    """Switches a loaded backend's target between paddings; each padding keeps the step costs its runs measured."""

    def __init__(self, backend: LocalBackend, paddings: tuple[int, ...]):
        self.backend = backend
        self.layers = [m for m in backend.target.model.modules() if isinstance(m, PackedLinear)]
        if not self.layers:
            raise SystemExit("the target has no prepacked Linears (not a CPU with oneDNN): nothing is padded")
        self.costs = dict.fromkeys(paddings)  # rows -> the policy's costs measured under that padding
        self.loaded = (self.layers[0].min_rows, backend.costs)

    def use(self, rows: int) -> None:
        for layer in self.layers:
            layer.min_rows = rows
        if self.costs[rows] is None:
            draft = self.backend.draft.model if self.backend.draft else None
            self.costs[rows] = calibration.measure(self.backend.target.model, draft)
        self.backend.costs = self.costs[rows]

    def restore(self) -> None:
        """The padding and the costs the backend had before."""
        rows, self.backend.costs = self.loaded
        for layer in self.layers:
            layer.min_rows = rows


def compare(backend: LocalBackend, requests: list, paddings: tuple[int, ...] = (MIN_ROWS, 1),
            warm=None) -> list[dict]:
    """Per request {(engine, rows): tok/s} plus "identical": every run's output equals the padded baseline's."""
    switch = Paddings(backend, paddings)
    runs = [(engine, rows) for engine in ENGINES for rows in paddings]
    if warm is not None:
        for engine, rows in runs:
            switch.use(rows)
            run_engine(backend, engine, warm)
    rows_out = []
    for i, req in enumerate(tqdm(requests, desc="padded vs unpadded", unit="prompt")):
        results = {}
        for engine, rows in runs[::-1] if i % 2 else runs:
            switch.use(rows)
            results[engine, rows] = run_engine(backend, engine, req)
        first = results["baseline", paddings[0]].output_ids
        row = {key: len(r.output_ids) / r.total_s for key, r in results.items()}
        row["identical"] = all(r.output_ids == first for r in results.values())
        rows_out.append(row)
    switch.restore()
    return rows_out


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    setup()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_sample_args(p)
    args = p.parse_args(argv)
    plan = sample_plan(args)

    method = PRESETS[DEFAULT_PRESET].method
    backend = LocalBackend.from_preset(DEFAULT_PRESET)
    base = build_request("-", method=method, max_new_tokens=args.max_new_tokens)
    requests = [dataclasses.replace(base, prompt=item.prompt, earlier_turns=item.earlier_turns) for _, item in plan]
    warm = dataclasses.replace(base, prompt="Hello", max_new_tokens=8)
    rows = compare(backend, requests, warm=warm)

    pad, none = MIN_ROWS, 1
    out = sys.stdout
    out.write(f"\nPadded (passes under {pad} rows run as {pad}) vs unpadded target passes: "
              f"{describe_prompts(plan, args.sample_seed)}; greedy, {args.max_new_tokens} new tokens; default preset; "
              f"{machine()}; {time.strftime('%Y-%m-%d %H:%M')}.\n\n")
    out.write("| prompt | category | baseline tok/s padded / unpadded | ours tok/s padded / unpadded | identical |\n"
              "| --- | --- | --- | --- | --- |\n")
    for n, ((_, item), row) in enumerate(zip(plan, rows), 1):
        out.write(f"| {n} | {item.category} | {row['baseline', pad]:.2f} / {row['baseline', none]:.2f} | "
                  f"{row['speculative', pad]:.2f} / {row['speculative', none]:.2f} | {row['identical']} |\n")
    ratio = lambda a, b: [r[a] / r[b] for r in rows]  # noqa: E731
    times = "{:.2f}x"
    out.write(f"\n| median over {len(rows)} prompts [95% CI] | |\n| --- | --- |\n"
              f"| baseline, padded / unpadded | {with_ci(ratio(('baseline', pad), ('baseline', none)), times)} |\n"
              f"| ours, padded / unpadded | {with_ci(ratio(('speculative', pad), ('speculative', none)), times)} |\n"
              f"| speedup against the padded baseline (both padded) | "
              f"{with_ci(ratio(('speculative', pad), ('baseline', pad)), times)} |\n"
              f"| speedup against the unpadded baseline (both unpadded) | "
              f"{with_ci(ratio(('speculative', none), ('baseline', none)), times)} |\n"
              f"| identical output (all four runs) | {sum(r['identical'] for r in rows)}/{len(rows)} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
