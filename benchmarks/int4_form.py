"""The int4 target's Q4_K Linears with their scales in the GGUF's form (engine.exact.grouped_int8.GroupedQ4KLinear:
float16 d and dmin per super-block, a byte of sc and m per group) against float32 scale and low per group
(GroupedInt4Linear), in one process. Both compute the same bits; the first reads fewer. The second model is the
first with each of those Linears replaced by a GroupedInt4Linear on the same codes (the same memory) and float32
scales: every other tensor is shared, so the two differ only in their scales. (Two separately loaded copies of one
form differed by 3 % on this machine, 2026-12-06: where a model's memory lies matters at that level.)

    python -m benchmarks.int4_form                          # the console's target, 20 rounds
    python -m benchmarks.int4_form --rounds 30 --burst 5 --context 300

Prints the bytes of every Linear's tensors (what a decoding step reads: each weight once), then, after --context
tokens of code, passes of 1 row (a decoding step) and of 5 rows (a verify pass), and a prefill of --context tokens
from an empty cache, ms per form. The two forms take turns pass by pass, the first swapped every round, so that the
load of a shared machine favours neither; a round times --burst passes of each form (one prefill) and keeps each
form's fastest, which drops the passes another process interrupted. Per pass kind the median over rounds of each
form's ms, and the median of the rounds' ratios (scale form / float32) with its 95 % bootstrap interval and their
quartiles. Also checks that the two forms' logits are the same bits.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys

import torch

from benchmarks.doc_table import machine_kind
from benchmarks.timing import code_context, timed
from engine.analysis.stats import bootstrap_ci
from engine.exact.forward import forward, new_cache, rollback
from engine.exact.grouped_int8 import GroupedInt4Linear, GroupedInt8Linear, GroupedQ4KLinear, int4_of_gguf
from engine.exact.optimize import finish, linear_converter
from engine.loading.gguf_load import load_gguf_model
from engine.loading.weights import gguf_model
from engine.presets import DEFAULT_PRESET, PRESETS
from engine.setup import setup


def with_float32_scales(model):
    """`model` with each GroupedQ4KLinear as a GroupedInt4Linear on its codes (shared) and its scales in float32;
    every other tensor shared too."""
    twin = copy.deepcopy(model, memo={id(t): t for t in [*model.parameters(), *model.buffers()]})
    for name, layer in list(twin.named_modules()):
        if isinstance(layer, GroupedQ4KLinear):
            floats = GroupedInt4Linear.shell(layer.in_features, layer.out_features, layer.bias is not None)
            floats.code, floats.bias, floats.vnni = layer.code, layer.bias, layer.vnni
            floats.scale, floats.low = (t.contiguous() for t in layer.scales())
            parent, _, attr = name.rpartition(".")
            setattr(twin.get_submodule(parent), attr, floats)
    return twin


def linear_bytes(model) -> tuple[int, int]:
    """(bytes of all the kernel's Linears' tensors, of those in the Q4_K scale form)."""
    def size(m):
        return sum(b.nbytes for b in m.buffers())
    layers = [m for m in model.modules() if isinstance(m, GroupedInt8Linear)]
    return sum(map(size, layers)), sum(size(m) for m in layers if isinstance(m, GroupedQ4KLinear))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=PRESETS[DEFAULT_PRESET].target, help="a known model with Q4_K tensors")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--burst", type=int, default=3, help="passes of each form per round (prefill: 1)")
    parser.add_argument("--context", type=int, default=200, help="tokens before the timed passes; the prefill's length")
    args = parser.parse_args(argv)
    setup()
    logging.basicConfig(level=logging.WARNING)

    gguf, meta = gguf_model(args.target)
    convert = linear_converter("target", torch.device("cpu"), precision="int4")
    compact = finish(load_gguf_model(gguf, meta, convert, four_bit=int4_of_gguf), "target")
    models = {"Q4_K scales": compact, "float32 scales": with_float32_scales(compact)}
    print(f"{args.target} on {machine_kind()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for form, model in models.items():
        total, q4_k = linear_bytes(model)
        print(f"  {form}: the Linears' tensors {total / 1e9:.3f} GB (in the Q4_K scale form: {q4_k / 1e9:.3f} GB)")

    from transformers import AutoTokenizer

    context = code_context(AutoTokenizer.from_pretrained(meta), args.context)
    caches = {form: new_cache(model) for form, model in models.items()}
    logits = [forward(model, context, caches[form], keep=len(context)) for form, model in models.items()]
    print(f"  the same logits over {len(context)} tokens, bit for bit: {torch.equal(*logits)}")
    passes = {"decode, 1 row": 1, "verify, 5 rows": 5, f"prefill, {len(context)} rows": None}
    times = {(p, form): [] for p in passes for form in models}
    forms = list(models)
    for i in range(args.warmup + args.rounds):
        for name, rows in passes.items():
            fastest = {form: float("inf") for form in forms}
            for _ in range(1 if rows is None else args.burst):
                for form in forms if i % 2 == 0 else forms[::-1]:
                    model, cache = models[form], caches[form]
                    if rows is None:  # the prompt read into an empty cache
                        ms = timed(lambda: forward(model, context, new_cache(model), keep=1))
                    else:
                        ms = timed(lambda: forward(model, context[:rows], cache, keep=rows))
                        rollback(cache, len(context))
                    fastest[form] = min(fastest[form], ms)
            if i >= args.warmup:
                for form in forms:
                    times[name, form].append(fastest[form])
    print(f"  {args.rounds} rounds after {args.warmup} of warm-up, the fastest of {args.burst} passes of each form "
          f"a round (prefill: 1); ratio = {forms[0]} / {forms[1]}, per round:")
    for name in passes:
        a, b = times[name, forms[0]], times[name, forms[1]]
        ratios = [x / y for x, y in zip(a, b)]
        point, low, high = bootstrap_ci(ratios)
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"  {name:>18}: {statistics.median(a):8.2f} ms against {statistics.median(b):8.2f} ms, ratio "
              f"{point:.3f} [{low:.3f}, {high:.3f}] (quartiles {q1:.3f}-{q3:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
