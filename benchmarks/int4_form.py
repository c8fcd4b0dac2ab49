"""The int4 target in the GGUF's own forms against an older form of some of its Linears, in one process:
- `--against q6_k-int8` (the default): the Q6_K Linears (the head, half the down projections) on their own 6-bit codes
  and scales (engine.exact.grouped_int8.GroupedQ6KLinear, 0.82 bytes a weight) against int8 codes of the same weights
  (GroupedInt8Linear, 1.25 bytes a weight, which only approximate them: the logits differ);
- `--against q4_k-float32`: the Q4_K Linears with their scales in the GGUF's form (GroupedQ4KLinear: float16 d and dmin
  per super-block, a byte of sc and m per group) against float32 scale and low per group (GroupedInt4Linear) on the
  same codes (the same memory): the same bits from fewer bytes.
The second model is the first with those Linears replaced: every other tensor is shared, so the two differ only
there. (Two separately loaded copies of one form differed by 3 % on a 2-core AMD EPYC Zen 4, 2026-12-06: where a
model's memory lies matters at that level.)

    python -m benchmarks.int4_form                          # the console's target, 20 rounds
    python -m benchmarks.int4_form --against q4_k-float32 --rounds 30 --burst 5 --context 300

Prints (and writes into docs/memory.md, in place of its machine's and --against's table; --no-doc: print only) the
bytes of every Linear's tensors (what a decoding step reads: each weight once), then, after --context
tokens of code, passes of 1 row (a decoding step) and of 5 rows (a verify pass), and a prefill of --context tokens
from an empty cache, ms per form. The two forms take turns pass by pass, the first swapped every round, so that the
load of a shared machine favours neither; a round times --burst passes of each form (one prefill) and keeps each
form's fastest, which drops the passes another process interrupted. Per pass kind the median over rounds of each
form's ms, and the median of the rounds' ratios (the file's form / the other) with its 95 % bootstrap interval and their
quartiles. Also says whether the two forms' logits are the same bits.
"""

from __future__ import annotations

import argparse
import copy
import io
import logging
import statistics
import sys
import time

import torch

from benchmarks.doc_table import machine, machine_kind, write_table
from benchmarks.timing import add_avx2_option, code_context, kernel_code, timed
from engine.analysis.stats import bootstrap_ci
from engine.exact.forward import forward, new_cache, rollback
from torch import nn

from engine.exact.grouped_int8 import (GroupedInt4Linear, GroupedInt8Linear, GroupedQ4KLinear, GroupedQ6KLinear,
                                       int4_of_gguf)
from engine.exact.optimize import finish, linear_converter
from engine.loading.gguf_load import load_gguf_model
from engine.loading.weights import gguf_model
from engine.presets import DEFAULT_PRESET, PRESETS
from engine.setup import setup


def float32_scales(layer: GroupedQ4KLinear) -> GroupedInt4Linear:
    """The layer as a GroupedInt4Linear on its codes (shared) with its scales in float32."""
    floats = GroupedInt4Linear.shell(layer.in_features, layer.out_features, layer.bias is not None)
    floats.code, floats.bias, floats.vnni = layer.code, layer.bias, layer.vnni
    floats.scale, floats.low = (t.contiguous() for t in layer.scales())
    return floats


def int8_codes(layer: GroupedQ6KLinear) -> GroupedInt8Linear:
    """The layer's weights as int8 codes: what int4_of_gguf falls back to for a tensor whose terms it cannot use."""
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    linear.weight.data = layer.dequantized()
    if layer.bias is not None:
        linear.bias.data = layer.bias
    return GroupedInt8Linear(linear)


# --against: the layers replaced, and by what
AGAINST = {"q6_k-int8": (GroupedQ6KLinear, int8_codes, "Q6_K codes", "int8 codes"),
           "q4_k-float32": (GroupedQ4KLinear, float32_scales, "Q4_K scales", "float32 scales")}


def twin(model, kind: type, replace):
    """`model` with each `kind` Linear replaced by replace(layer); every other tensor shared."""
    twin = copy.deepcopy(model, memo={id(t): t for t in [*model.parameters(), *model.buffers()]})
    for name, layer in list(twin.named_modules()):
        if isinstance(layer, kind):
            parent, _, attr = name.rpartition(".")
            setattr(twin.get_submodule(parent), attr, replace(layer))
    return twin


def linear_bytes(model, kind: type) -> tuple[int, int]:
    """(bytes of all the kernel's Linears' tensors, of those of `kind`)."""
    def size(m):
        return sum(b.nbytes for b in m.buffers())
    layers = [m for m in model.modules() if isinstance(m, GroupedInt8Linear)]
    return sum(map(size, layers)), sum(size(m) for m in layers if isinstance(m, kind))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=PRESETS[DEFAULT_PRESET].target,
                        help="a known model with Q4_K and Q6_K tensors")
    parser.add_argument("--against", choices=AGAINST, default="q6_k-int8")
    parser.add_argument("--rounds", type=int, default=20, help="at least 2: the ratios' quartiles need two")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--burst", type=int, default=3, help="passes of each form per round (prefill: 1)")
    parser.add_argument("--context", type=int, default=200, help="tokens before the timed passes; the prefill's length")
    add_avx2_option(parser)
    parser.add_argument("--no-doc", action="store_true", help="print only; leave docs/memory.md as it is")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2")
    setup()
    logging.basicConfig(level=logging.WARNING)

    gguf, meta = gguf_model(args.target)
    convert = linear_converter("target", torch.device("cpu"), precision="int4")
    compact = finish(load_gguf_model(gguf, meta, convert, own_codes=int4_of_gguf), "target")
    kind, replace, ours, theirs = AGAINST[args.against]
    models = {ours: compact, theirs: twin(compact, kind, replace)}
    forms = list(models)
    kernel = kernel_code(models.values(), args.avx2)
    print(f"{args.target} on {machine_kind()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    sizes = {form: linear_bytes(model, kind) for form, model in models.items()}

    from transformers import AutoTokenizer

    context = code_context(AutoTokenizer.from_pretrained(meta), args.context)
    caches = {form: new_cache(model) for form, model in models.items()}
    logits = [forward(model, context, caches[form], keep=len(context)) for form, model in models.items()]
    same = (f"the same logits over {len(context)} tokens, bit for bit: {torch.equal(*logits)} (the largest "
            f"difference {(logits[0] - logits[1]).abs().max().item():.3g}; the same top token at "
            f"{(logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item():.1%} of the positions)")
    passes = {"decode, 1 row": 1, "verify, 5 rows": 5, f"prefill, {len(context)} rows": None}
    times = {(p, form): [] for p in passes for form in models}
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

    out = io.StringIO()
    command = " ".join(["python -m benchmarks.int4_form", *(argv if argv is not None else sys.argv[1:])])
    out.write(f"\n#### {machine_kind()}: {ours} against {theirs}, the {kernel} kernel\n\n`{command}`: {args.target}, "
              f"int4 target, the kernel's {kernel} code; "
              f"{args.rounds} rounds after {args.warmup} of warm-up, the fastest of {args.burst} passes of each form a "
              f"round (prefill: 1); ratio = {ours} / {theirs}, median over rounds [95 % bootstrap interval] (quartiles); "
              f"{same}; machine: {machine()}, torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M')}\n\n")
    out.write(f"| | {ours} | {theirs} | ratio |\n| --- | --- | --- | --- |\n")
    (total, own), (other_total, _) = sizes[ours], sizes[theirs]
    out.write(f"| the Linears' tensors, read once a decoding step ({ours}: {own / 1e9:.3f} GB) | {total / 1e9:.3f} GB | "
              f"{other_total / 1e9:.3f} GB | {total / other_total:.3f} |\n")
    for name in passes:
        a, b = times[name, ours], times[name, theirs]
        ratios = [x / y for x, y in zip(a, b)]
        point, low, high = bootstrap_ci(ratios)
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        out.write(f"| {name} | {statistics.median(a):.2f} ms | {statistics.median(b):.2f} ms | **{point:.3f}** "
                  f"[{low:.3f}, {high:.3f}] ({q1:.3f}-{q3:.3f}) |\n")
    sys.stdout.write(out.getvalue())
    if not args.no_doc:
        write_table("memory.md", f"int4 form / {machine_kind()} / {args.target} {args.against} {kernel.split()[0]}",
                    out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
