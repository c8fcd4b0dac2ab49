"""The target's Linears in float32 (engine.exact.optimize.PackedLinear, the reference) against fewer bytes a weight: float16
(engine.exact.precision.HalfLinear) and two weight-only int8 candidates torch has, side by side in one process.

    python -m benchmarks.target_precision                     # layers: 6 blocks of Qwen2.5-1.5B's Linear shapes
    python -m benchmarks.target_precision --rows 1 5 9 17 64 --repeats 9
    python -m benchmarks.target_precision --model             # the real target, float32 and float16, greedy runs
    python -m benchmarks.target_precision --model --against int8 --humaneval-prompts 4 --mtbench-prompts 4 --tokens 64

Layers: random weights in the shapes of --blocks transformer blocks of the default target (1.1 GB of float32 for 6,
more than the CPU's caches, as the 28 real ones are), one pass of m rows through all of them per variant. The variants
take turns in every repeat, their order rotated, so that the load of a shared machine favours none; medians, and
each variant's speed as a multiple of float32's. The int8 candidates (aten._weight_int8pack_mm with per-output-channel
scales) run only up to --int8-max-rows rows: with float32 activations (what per-row exactness needs) it is a scalar
loop; with bfloat16 activations it is vectorized but rounds the activations, so it is not the float32 model.

--model: loads the default target twice (float32 and --against: float16 or int8) and decodes --prompts prompts (or
the seeded HumanEval / MT-Bench sample) greedily with each, one pass of each in turn; prints decode tok/s (from the
median step after the prompt) per run and whether the two outputs agree (the number of identical leading tokens).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch
from torch import nn

from engine.exact.optimize import linear_converter
from engine.exact.precision import PRECISIONS
from engine.setup import setup

log = logging.getLogger("benchmarks.target_precision")

TARGET = "qwen2.5-coder-1.5b-instruct"
# one transformer block of Qwen2.5-1.5B: q, k, v (with biases), o, gate, up, down as (in, out, bias)
BLOCK = [(1536, 1536, True), (1536, 256, True), (1536, 256, True), (1536, 1536, False), (1536, 8960, False),
         (1536, 8960, False), (8960, 1536, False)]
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, then call it for n = 10.",
    "Explain what a hash map is and when to use one, in three sentences.",
    "Write a SQL query that lists the ten customers with the highest total order value.",
    "Tell a very short story about a lighthouse keeper.",
    "Write a bash one-liner that counts the lines of every .py file under the current directory.",
]


class Int8Rows(nn.Module):
    """A weight-only int8 Linear (per-output-channel scales) on aten._weight_int8pack_mm; `dtype`: the activations'."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.bias = linear.in_features, linear.bias
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.weight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale, self.dtype = scale.to(dtype), dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(self.dtype).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scale).float()
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], -1)


VARIANTS = {
    "float32": lambda: linear_converter("target", torch.device("cpu")),
    "float16": lambda: linear_converter("target", torch.device("cpu"), precision="float16"),
    "int8, float32 activations": lambda: (lambda linear: Int8Rows(linear, torch.float32)),
    "int8, bfloat16 activations": lambda: (lambda linear: Int8Rows(linear, torch.bfloat16)),
}
INT8 = ("int8, float32 activations", "int8, bfloat16 activations")


def build_layers(blocks: int) -> dict[str, list[nn.Module]]:
    """Each variant's Linears for `blocks` blocks, from the same random float32 weights (std 0.02, as trained)."""
    layers = {name: [] for name in VARIANTS}
    converters = {name: make() for name, make in VARIANTS.items()}
    gen = torch.Generator().manual_seed(0)
    for _ in range(blocks):
        for n_in, n_out, bias in BLOCK:
            linear = nn.Linear(n_in, n_out, bias=bias)
            with torch.no_grad():
                linear.weight.normal_(0, 0.02, generator=gen)
            for name, convert in converters.items():
                layers[name].append(convert(linear))
    return layers


def layer_ms(layers: dict[str, list[nn.Module]], rows: list[int], repeats: int, int8_max_rows: int
             ) -> dict[tuple[str, int], list[float]]:
    """ms of one pass of m rows through every Linear, per (variant, m); the variants take turns, order rotated."""
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for m in rows:
            inputs = {n_in: torch.randn(1, m, n_in) for n_in in {n_in for n_in, _, _ in BLOCK}}
            names = [name for name in layers if m <= int8_max_rows or name not in INT8]
            for i in range(repeats + 1):  # the first round warms up
                for name in names[i % len(names):] + names[: i % len(names)]:
                    t = time.perf_counter()
                    for layer in layers[name]:
                        layer(inputs[layer.in_features])
                    if i:
                        times.setdefault((name, m), []).append(1000 * (time.perf_counter() - t))
            log.info("%d rows done", m)
    return times


def report_layers(times, rows: list[int], blocks: int, repeats: int, out) -> None:
    weights = blocks * sum(n_in * n_out for n_in, n_out, _ in BLOCK)
    out.write(f"\n{blocks} blocks of Qwen2.5-1.5B's Linears ({weights / 1e6:.0f}M weights), one pass of m rows through "
              f"all, median of {repeats} interleaved repeats (interquartile range); {torch.get_num_threads()} threads; "
              "speed as a multiple of float32's (PackedLinear, padded to 5 rows).\n\n")
    names = list(VARIANTS)
    out.write("| m | " + " | ".join(names) + " |\n|" + " --- |" * (1 + len(names)) + "\n")
    for m in rows:
        base = statistics.median(times["float32", m])
        cells = []
        for name in names:
            if (name, m) not in times:
                cells.append("not run")
                continue
            t = times[name, m]
            q1, _, q3 = statistics.quantiles(t, n=4, method="inclusive") if len(t) > 1 else (t[0], 0, t[0])
            cells.append(f"{statistics.median(t):.1f} ms ({q1:.0f}-{q3:.0f}), {base / statistics.median(t):.2f}x")
        out.write(f"| {m} | " + " | ".join(cells) + " |\n")


def in_turns(generators: list) -> list:
    """Run engine generators one target pass each in turn; their RunResults, in order."""
    from engine.events import RunResult, StepRecord

    results, live = [None] * len(generators), dict(enumerate(generators))
    while live:
        for i, gen in list(live.items()):
            for event in gen:
                if isinstance(event, RunResult):
                    results[i] = event
                    del live[i]
                    break
                if isinstance(event, StepRecord):
                    break
    return results


def compare_models(prompts: list[str], tokens: int, out, other: str = "float16") -> None:
    """float32 against `other` on the real target: decode speed, and where their greedy outputs part."""
    from engine.exact.decode import generate_baseline
    from engine.sampling_params import SamplingParams
    from engine.exact.models import load
    from engine.prompts import encode_prompt
    from engine.stops import StopConditions

    models = {p: load(TARGET, "target", torch.device("cpu"), precision=p) for p in ("float32", other)}
    out.write(f"\n{TARGET}, greedy, {tokens} new tokens at most (EOS stops); the two targets take turns pass by pass; "
              f"{torch.get_num_threads()} threads. Weights: "
              + ", ".join(f"{p} {m.nbytes / 2**30:.2f} GiB" for p, m in models.items()) + "\n\n")
    out.write(f"| prompt | float32 decode tok/s | {other} decode tok/s | ratio | prefill ms float32 / {other} | "
              "identical leading tokens |\n|" + " --- |" * 6 + "\n")
    ratios, identical = [], 0
    for n, text in enumerate(prompts):
        order = list(models) if n % 2 == 0 else list(models)[::-1]  # who goes first alternates
        gens = [generate_baseline(m.model, m.tokenizer, encode_prompt(m.tokenizer, text), SamplingParams(),
                                  StopConditions(tokens, m.eos_ids)) for m in (models[p] for p in order)]
        runs = dict(zip(order, in_turns(gens)))
        # from the median decoding step: robust to the moments another process takes the cores
        speed = {p: 1000 / statistics.median(s.verify_ms for s in r.steps if s.step > 0) for p, r in runs.items()}
        a, b = runs["float32"].output_ids, runs[other].output_ids
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        identical += a == b
        agree = f"all {same}" if a == b else f"{same} of {len(a)} (then {a[same:same + 1]} vs {b[same:same + 1]})"
        ratios.append(speed[other] / speed["float32"])
        out.write(f"| {n + 1} | {speed['float32']:.2f} | {speed[other]:.2f} | {ratios[-1]:.2f}x | "
                  f"{runs['float32'].prefill_ms:.0f} / {runs[other].prefill_ms:.0f} | {agree} |\n")
        out.flush()
    out.write(f"\nMedian ratio {other} / float32 decode speed: {statistics.median(ratios):.2f}x; greedy output "
              f"identical on {identical} of {len(prompts)} prompts\n")


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    setup()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=6, help="transformer blocks of Linears (28 in the real target)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9, 17, 64], help="rows per pass (m)")
    p.add_argument("--repeats", type=int, default=7, help="timed passes per variant and m")
    p.add_argument("--int8-max-rows", type=int, default=9, help="the int8 candidates run up to this many rows")
    p.add_argument("--model", action="store_true", help="instead: the real target, float32 vs --against, greedy runs")
    p.add_argument("--against", default="float16", choices=[q for q in PRECISIONS if q != "float32"],
                   help="--model: the precision compared with float32")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"--model: prompts (at most {len(PROMPTS)})")
    p.add_argument("--tokens", type=int, default=32, help="--model: new tokens per run")
    p.add_argument("--humaneval-prompts", type=int, default=0, help="--model: HumanEval's seeded sample instead")
    p.add_argument("--mtbench-prompts", type=int, default=0, help="--model: MT-Bench's seeded sample (with the above)")
    p.add_argument("--sample-seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.model:
        prompts = PROMPTS[: args.prompts]
        if args.humaneval_prompts or args.mtbench_prompts:
            from benchmarks.speed import sample_plan

            prompts = [item.prompt for _, item in sample_plan(args)]
        compare_models(prompts, args.tokens, sys.stdout, args.against)
        return 0
    layers = build_layers(args.blocks)
    times = layer_ms(layers, args.rows, args.repeats, args.int8_max_rows)
    report_layers(times, args.rows, args.blocks, args.repeats, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
