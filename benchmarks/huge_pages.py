"""The console's models with their weights where their stored forms load them (the target's mapped from its file,
the draft's read into torch's memory, both in 4 KiB pages) against the same models moved into huge pages
(engine.exact.huge_pages), in one process. The console moves both.

    python -m benchmarks.huge_pages                 # the default preset, 20 rounds
    python -m benchmarks.huge_pages --rounds 30 --burst 5

After --context tokens of code: a target pass of 1 row (a decoding step), of 5 rows (a verify pass), and a draft
pass of 1 row, ms per placement. The placements take turns pass by pass, the first swapped every round, so that the
load of a shared machine favours neither; a round keeps each placement's fastest of --burst passes. Per pass kind the
median over rounds, and the median of the rounds' ratios (huge pages / before) with its 95 % bootstrap interval.
Also checks that both placements give the same logits, bit for bit. The table goes to docs/memory.md.
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import sys
import time

import torch

from benchmarks.doc_table import machine, machine_kind, write_table
from benchmarks.timing import code_context, timed
from engine.analysis.stats import bootstrap_ci
from engine.exact import huge_pages
from engine.exact.forward import forward, new_cache, rollback
from engine.exact.int8_store import load_stored, store_path
from engine.exact.models import load
from engine.exact.optimize import finish
from engine.loading.weights import gguf_model
from engine.presets import DEFAULT_PRESET, PRESETS
from engine.setup import setup

FORMS = ("before", "huge pages")


def placements(spec: str, role: str, precision: str) -> dict:
    """The model of `spec` as its stored form loads without huge pages, and a second copy moved into them."""
    load(spec, role, int8=role == "draft", precision=precision)  # builds the stored form where there is none yet
    gguf, meta = gguf_model(spec)
    stored = store_path(gguf, precision if role == "target" else f"draft-{precision}")
    models = {form: finish(load_stored(stored, meta, mmap=role == "target"), role) for form in FORMS}
    moved = huge_pages.move(models["huge pages"])
    print(f"  {role} {spec}: {moved / 1e9:.2f} GB of its weights in huge pages")
    return models


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    parser.add_argument("--precision", default="int4", choices=("int4", "int8"))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--burst", type=int, default=3, help="passes of each placement per round")
    parser.add_argument("--context", type=int, default=200, help="tokens before the timed passes")
    parser.add_argument("--no-doc", action="store_true", help="print only; leave docs/memory.md as it is")
    args = parser.parse_args(argv)
    setup()
    logging.basicConfig(level=logging.WARNING)
    preset = PRESETS[args.preset]
    print(f"{args.preset} on {machine_kind()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    models = {"target": placements(preset.target, "target", args.precision),
              "draft": placements(preset.draft, "draft", args.precision)}

    from transformers import AutoTokenizer

    context = code_context(AutoTokenizer.from_pretrained(gguf_model(preset.target)[1]), args.context)
    caches = {(role, form): new_cache(m) for role, pair in models.items() for form, m in pair.items()}
    for (role, form), cache in caches.items():
        forward(models[role][form], context, cache, keep=1)
    same = all(torch.equal(*[forward(m, context[:5], caches[role, f], keep=5) for f, m in pair.items()])
               for role, pair in models.items())
    for (role, _), cache in caches.items():
        rollback(cache, len(context))
    passes = {"target, 1 row (decoding step)": ("target", 1), "target, 5 rows (verify)": ("target", 5),
              "draft, 1 row": ("draft", 1)}
    times = {(p, form): [] for p in passes for form in FORMS}
    for i in range(args.warmup + args.rounds):
        for name, (role, rows) in passes.items():
            fastest = dict.fromkeys(FORMS, float("inf"))
            for _ in range(args.burst):
                for form in FORMS if i % 2 == 0 else FORMS[::-1]:
                    cache = caches[role, form]
                    fastest[form] = min(fastest[form], timed(
                        lambda: forward(models[role][form], context[:rows], cache, keep=rows)))
                    rollback(cache, len(context))
            if i >= args.warmup:
                for form in FORMS:
                    times[name, form].append(fastest[form])

    out = io.StringIO()
    command = " ".join(["python -m benchmarks.huge_pages", *(argv if argv is not None else sys.argv[1:])])
    out.write(f"\n#### {machine_kind()}: weights in huge pages\n\n`{command}`: preset {args.preset}, "
              f"{args.precision} target; {args.rounds} rounds after {args.warmup} of warm-up, the fastest of "
              f"{args.burst} passes of each placement a round; ratio = huge pages / before, median over rounds "
              f"[95 % bootstrap interval]; the same logits bit for bit: {same}; machine: {machine()}, "
              f"torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M')}\n\n")
    out.write(f"| pass | {FORMS[0]} | {FORMS[1]} | ratio |\n| --- | --- | --- | --- |\n")
    for name in passes:
        a, b = times[name, FORMS[0]], times[name, FORMS[1]]
        point, low, high = bootstrap_ci([y / x for x, y in zip(a, b)])
        out.write(f"| {name} | {statistics.median(a):.2f} ms | {statistics.median(b):.2f} ms | "
                  f"**{point:.3f}** [{low:.3f}, {high:.3f}] |\n")
    sys.stdout.write(out.getvalue())
    if not args.no_doc:
        write_table("memory.md", f"huge pages / {machine_kind()} / {args.preset} {args.precision}", out.getvalue())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
