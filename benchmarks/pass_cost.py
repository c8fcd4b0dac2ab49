"""Micro-benchmark: how long one target forward pass over m tokens takes, m = 1 (a plain step) to k_max + 1 (a full
verify), the curve that the per-token draft stop reads (engine.exact.policy: verify(m), learned per m during runs).

    python -m benchmarks.pass_cost                       # the default target: Qwen2.5-Coder-1.5B, prepacked float32
    python -m benchmarks.pass_cost --sizes 1 2 3 4 8 17 --rounds 20
    python -m benchmarks.pass_cost --min-rows 5 1         # padded to 5 rows (the engines' default) and unpadded
    python -m benchmarks.pass_cost --precision float16    # the float16 target (no padding: it needs none)
    python -m benchmarks.pass_cost --draft qwen2.5-coder-0.5b-instruct --sizes 1   # the int8 draft's step, same turns

Loads the target once, as the engine does. A warm KV cache of --context tokens (the start of engine/exact/proposers.py),
then one pass of m tokens, the cache cropped back after it; the sizes take turns round by round, so that a drift in
the machine's speed favours none. Prints the median ms per m and its ratio to a plain step (m = 1). With several
--min-rows, each m is also timed with the target's short passes padded to each of them (engine.exact.optimize.MIN_ROWS),
in the same turns. On a shared machine the times are noisy; run it alone.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys

import torch

from benchmarks.timing import code_context, forward_ms_in_turns
from engine.exact.forward import forward
from engine.exact.models import load
from engine.exact.optimize import MIN_ROWS, PackedLinear
from engine.exact.precision import PRECISIONS
from engine.setup import setup

TARGET = "qwen2.5-coder-1.5b-instruct"


def pass_ms(model, context: list[int], sizes: list[int], rounds: int) -> dict[int, list[float]]:
    """ms of each timed forward pass over m tokens after `context`, per m; the sizes take turns."""
    # any m tokens: the cost does not depend on which
    configs = {m: (lambda cache, m=m: forward(model, context[:m], cache, keep=m)) for m in sizes}
    return forward_ms_in_turns(model, context, configs, rounds, warmup=2)


def padded_pass_ms(model, context: list[int], sizes: list[int], paddings: list[int], rounds: int
                   ) -> dict[tuple[int, int], list[float]]:
    """As pass_ms, per (m, min_rows): each pass runs with the target's Linears padding to min_rows rows."""
    layers = [module for module in model.modules() if isinstance(module, PackedLinear)]
    loaded = {layer: layer.min_rows for layer in layers}

    def one_pass(cache, m, rows):
        for layer in layers:
            layer.min_rows = rows
        forward(model, context[:m], cache, keep=m)

    configs = {(m, rows): (lambda cache, m=m, rows=rows: one_pass(cache, m, rows)) for m in sizes for rows in paddings}
    try:
        return forward_ms_in_turns(model, context, configs, rounds, warmup=2)
    finally:
        for layer, rows in loaded.items():
            layer.min_rows = rows


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    setup()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=TARGET, help="target model (a known name, a directory or a .gguf file)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 10, 12, 17],
                   help="tokens per pass (m = drafts + 1)")
    p.add_argument("--context", type=int, default=200, help="tokens in the KV cache before each pass")
    p.add_argument("--rounds", type=int, default=12, help="timed passes per size")
    p.add_argument("--min-rows", type=int, nargs="+", default=[MIN_ROWS],
                   help="short passes padded to this many rows (1: none); several: each, side by side")
    p.add_argument("--precision", default="float32", choices=PRECISIONS, help="the target's (engine.exact.precision)")
    p.add_argument("--draft", help="also time this draft model (loaded as the engines load a draft: int8), per m")
    args = p.parse_args(argv)

    target = load(args.target, "target", precision=args.precision)
    context = code_context(target.tokenizer, args.context)
    if max(args.sizes) > len(context):
        raise SystemExit(f"--sizes: at most {len(context)} tokens per pass with --context {args.context}")
    with torch.inference_mode():
        ms = padded_pass_ms(target.model, context, args.sizes, args.min_rows, args.rounds)
        if args.draft:  # timed after the target's turns
            draft = load(args.draft, "draft", int8=True)
            draft_ms = pass_ms(draft.model, context, args.sizes, args.rounds)

    out = sys.stdout
    named = target.name if args.precision != "float32" else f"{target.name} (float32)"  # float16 names itself
    out.write(f"\nTarget {named} on {target.device}; one forward pass over m tokens after "
              f"{len(context)} cached tokens, median of {args.rounds} (interquartile range); "
              f"{torch.get_num_threads()} threads. "
              f"\"Padded to n\": passes under n rows run as n rows; the ratio is to a plain step (m = 1) padded to "
              f"{args.min_rows[0]}." + (" float16 pads nothing: every column times the same passes." if
                                        args.precision != "float32" else "") + "\n\n")
    out.write("| m (drafts + 1) | " + " | ".join(f"padded to {r}: ms / pass | vs a plain step" for r in args.min_rows)
              + " |\n|" + " --- |" * (1 + 2 * len(args.min_rows)) + "\n")
    base = statistics.median(ms[args.sizes[0], args.min_rows[0]]) if args.sizes[0] == 1 else None
    for m in args.sizes:
        cells = []
        for rows in args.min_rows:
            times = ms[m, rows]
            value = statistics.median(times)
            q1, _, q3 = statistics.quantiles(times, n=4)
            cells += [f"{value:.1f} ({q1:.0f}-{q3:.0f})", f"{value / base:.2f}x" if base else "n/a"]
        out.write(f"| {m} | " + " | ".join(cells) + " |\n")
    if args.draft:
        out.write(f"\nDraft {draft.name} (int8), the same passes; the ratio is to the target's plain step above.\n\n"
                  "| m | ms / pass | vs the target's plain step |\n| --- | --- | --- |\n")
        for m in args.sizes:
            value = statistics.median(draft_ms[m])
            out.write(f"| {m} | {value:.1f} | {value / base:.2f}x |\n" if base else f"| {m} | {value:.1f} | n/a |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
