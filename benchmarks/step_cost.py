"""What a target pass over m rows and a draft step cost with this checkout's forward, KV cache and kernel, against
the model's own transformers forward, against transformers' DynamicCache, against the decoder's layers in Python
(engine.exact.decoder runs them in C++ on the int8 kernel) and against another revision's kernel, side by side.

    python -m benchmarks.step_cost                          # against the model's own forward, DynamicCache, Python
    python -m benchmarks.step_cost --context 600            # the same after 600 cached tokens
    python -m benchmarks.step_cost --kernel-of 2b0f668      # also the int8 kernel of that git revision (its
                                                            # layers in Python: compare with that column)
    python -m benchmarks.step_cost --kernel-of 2b0f668 --avx2   # the kernel's AVX2 code, on a CPU with VNNI

The console's models as it loads them (the default preset, int4 target, its draft). A warm cache of --context
tokens, then one pass of m rows, cropped back; every configuration runs each pass in turn, the first swapped every
round, so that a drift in the machine's speed favours none. Prints the median ms per configuration and each one's
ratio to this checkout's, median over rounds with a 95 % bootstrap interval, and writes the table into
docs/memory.md (--no-doc: print only). Run it alone: the times are the machine's.
"""

from __future__ import annotations

import argparse
import io
import logging
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import DynamicCache

from benchmarks.doc_table import machine, machine_kind, write_table
from benchmarks.timing import add_avx2_option, code_context, kernel_code, timed
from engine.analysis.stats import bootstrap_ci
from engine.exact import decoder, grouped_int8
from engine.exact.forward import forward, new_cache, rollback
from engine.exact.models import load
from engine.presets import DEFAULT_PRESET, PRESETS
from engine.setup import setup

ROOT = Path(__file__).resolve().parent.parent
THIS = "this checkout"
OWN = "the model's own forward"
DYNAMIC = "transformers' DynamicCache"
IN_PYTHON = "the decoder's layers in Python"
DEFAULT_CONTEXT = 200


def kernel_of(revision: str):
    """The int8 kernel as the git revision `revision` had it (with the sources it had beside it in the module),
    compiled into a temporary directory."""
    from torch.utils.cpp_extension import load as compile_extension

    build = Path(tempfile.mkdtemp(prefix="step-cost-"))
    sources = []
    for source in grouped_int8.SOURCES:
        shown = subprocess.run(["git", "show", f"{revision}:engine/exact/{source.name}"], cwd=ROOT,
                               capture_output=True, text=True)
        if shown.returncode == 0:  # a revision before decoder_layer.cpp has the kernel alone
            (build / source.name).write_text(shown.stdout)
            sources.append(str(build / source.name))
    name = "kernel_" + re.sub(r"\W", "_", revision)  # a module's name: HEAD~1 -> kernel_HEAD_1
    return compile_extension(name, sources, build_directory=str(build),
                             extra_cflags=list(grouped_int8.CFLAGS), extra_ldflags=list(grouped_int8.LDFLAGS))


def configurations(kernel_revision: str | None) -> dict[str, Callable[[], None]]:
    """Each configuration's set-up: a function that makes the engines' passes run that way (DYNAMIC's passes run as
    this checkout's, on another cache: `cache_for`)."""
    ours, runs, native = grouped_int8.kernel(), decoder.runs, decoder.native_layers

    def use(kernel, plain_forward: bool, layers_in_cpp: bool = True):
        grouped_int8.kernel = lambda: kernel  # the Linears look the kernel up at each call
        decoder.runs = runs if plain_forward else (lambda model: False)
        decoder.native_layers = native if layers_in_cpp else (lambda model: None)

    configs = {THIS: lambda: use(ours, True), OWN: lambda: use(ours, False), DYNAMIC: lambda: use(ours, True),
               IN_PYTHON: lambda: use(ours, True, layers_in_cpp=False)}
    if kernel_revision:
        theirs = kernel_of(kernel_revision)  # the layers in C++ call this checkout's kernel: in Python here
        configs[f"the kernel of {kernel_revision}, layers in Python"] = lambda: use(theirs, True, False)
    return configs


def cache_for(configuration: str, model):
    return DynamicCache(config=model.config) if configuration == DYNAMIC else new_cache(model)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernel-of", metavar="REVISION", help="also time the int8 kernel of this git revision")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 5, 8], help="target rows per pass")
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens in the cache before each pass")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    add_avx2_option(parser)
    parser.add_argument("--no-doc", action="store_true", help="print only; leave docs/memory.md as it is")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2")
    setup()
    logging.basicConfig(level=logging.WARNING)

    preset = PRESETS[DEFAULT_PRESET]
    target = load(preset.target, "target", precision="int4")
    draft = load(preset.draft, "draft", int8=preset.int8_draft, precision="int4")
    kernel = kernel_code((target.model, draft.model), args.avx2)
    context = code_context(target.tokenizer, args.context)
    configs = configurations(args.kernel_of)
    names = list(configs)
    passes = {f"target, {m} row{'s' * (m > 1)}": (target.model, m) for m in args.sizes}
    passes["draft step"] = (draft.model, 1)
    caches = {}  # per pass, one for DYNAMIC and one that the other configurations share
    for p, (model, _) in passes.items():
        for dynamic in (False, True):
            caches[p, dynamic] = cache_for(DYNAMIC if dynamic else THIS, model)
            forward(model, context, caches[p, dynamic], keep=1)
    times = {(p, c): [] for p in passes for c in names}
    for i in range(args.warmup + args.rounds):
        for p, (model, rows) in passes.items():
            for c in names if i % 2 == 0 else names[::-1]:
                configs[c]()
                cache = caches[p, c == DYNAMIC]
                ms = timed(lambda: forward(model, context[:rows], cache, keep=rows))
                rollback(cache, len(context))
                if i >= args.warmup:
                    times[p, c].append(ms)
    configs[THIS]()

    out = io.StringIO()
    command = " ".join(["python -m benchmarks.step_cost", *(argv if argv is not None else sys.argv[1:])])
    out.write(f"\n#### {machine_kind()}, the {kernel} kernel\n\n`{command}`: {target.name} and its draft {draft.name}, "
              f"{len(context)} tokens cached; {args.rounds} rounds after {args.warmup}; ratio = that configuration / "
              f"{THIS}, median over rounds [95 % bootstrap interval]; machine: {machine()}, "
              f"{torch.get_num_threads()} threads, torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M')}\n\n")
    others = names[1:]
    out.write(f"| pass | {THIS}: ms | " + " | ".join(f"{c}: ms | ratio" for c in others) + " |\n")
    out.write("| --- " * (2 + 2 * len(others)) + "|\n")
    for p in passes:
        base = times[p, THIS]
        cells = [f"{statistics.median(base):.1f}"]
        for c in others:
            point, low, high = bootstrap_ci([x / y for x, y in zip(times[p, c], base)])
            cells += [f"{statistics.median(times[p, c]):.1f}", f"**{point:.2f}** [{low:.2f}, {high:.2f}]"]
        out.write(f"| {p} | " + " | ".join(cells) + " |\n")
    sys.stdout.write(out.getvalue())
    if not args.no_doc:
        suffix = "" if args.context == DEFAULT_CONTEXT else f" / {args.context} tokens"
        write_table("memory.md", f"step cost / {machine_kind()} / {kernel.split()[0]}{suffix}", out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
