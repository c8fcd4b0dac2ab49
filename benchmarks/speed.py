"""Speed benchmark: our baseline vs our speculative engine vs Hugging Face assisted generation, on standard suites.

    python -m benchmarks.speed                        24 HumanEval + 16 MT-Bench prompts (2 per category), seed 0
    python -m benchmarks.speed --suite ours           the in-repo categories instead (or --categories code chat)
    python -m benchmarks.speed --preset smollm2-ngram --limit-prompts 2 --repeats 1 --max-new-tokens 16   quick check
    python -m benchmarks.speed --variants hybrid      levers side by side: each configuration runs on every prompt,
                                                      against the same baseline and HF runs of the same repeat

All four runs of a prompt use the same two model objects with the same optimisations (the console's target: int4
where its kernel runs, else prepacked float32; --precision picks another; the draft as the console runs it), greedy
decoding (whatever temperature a suite gives), the chat template (with a multi-turn prompt's earlier turns) and the
same token budget. Within one repeat a prompt runs on
all four back to back, in the reverse order on odd repeats so that a drift in the machine's speed favours none of
them; repeats are full passes over the prompts. Per prompt, each figure is the median over repeats of the figure
measured within one repeat (speedup, ours/HF are within-repeat ratios); per category, per suite and overall, the
median over prompts, with a 95 % percentile bootstrap interval over prompts for speedup and ours/HF. Machine noise:
the coefficient of variation of the baseline's tok/s over the repeats of a prompt (median over prompts). A preset
without a draft model (n-gram drafting) has nothing to hand HF assisted generation: its columns read n/a and HF is
not run.
Prints a markdown table; nothing here is a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import math
import statistics
import sys
import time

import torch

from benchmarks.doc_table import machine
from engine.exact.backend import LocalBackend
from engine.exact.precision import AUTO, PRECISIONS
from engine.methods import METHODS
from engine.drafting import SERVER_SETTINGS, Drafting
from engine.request import Request
from engine.events import RunResult
from engine.metrics import compare, first_divergence
from engine.presets import PRESETS
from engine.prompts import encode_prompt
from engine.exact.optimize import MIN_ROWS
from engine.setup import setup
from engine.analysis.stats import bootstrap_ci
from specconsole.suites import EXTERNAL_SUITES, SuitePrompt, categories, load_external, load_suite

log = logging.getLogger("benchmarks.speed")

NOISE_WARNING = 0.10  # above this coefficient of variation, single figures are not to be trusted
ENGINES = ("baseline", "speculative", "hf", "hf_assisted")
NAN = float("nan")


class PassCounter:
    """Counts target forward passes (to check how many steps HF assisted generation really took)."""

    def __init__(self, model):
        self.count = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.count += 1


def run_engine(backend, engine: str, req: Request) -> RunResult:
    """One run on "baseline", "speculative" or an extra speculative engine of the backend ("speculative-2" ...)."""
    if engine in ("baseline", "speculative"):
        *_, result = (backend.baseline if engine == "baseline" else backend.speculative)(req)
    else:
        *_, result = backend.speculative(req, engine=engine)
    if result.error:
        raise RuntimeError(f"{engine} failed: {result.error}")
    return result


def run_hf(backend, req: Request, assisted: bool, counter: PassCounter) -> tuple[list[int], float, int]:
    t = backend.target
    ids = torch.tensor([encode_prompt(t.tokenizer, req.prompt, req.chat, req.earlier_turns)], device=t.device)
    kwargs = dict(
        max_new_tokens=req.max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
        eos_token_id=sorted(t.eos_ids), pad_token_id=t.tokenizer.pad_token_id or sorted(t.eos_ids)[0],
    )
    if assisted:
        kwargs["assistant_model"] = backend.draft.model
    counter.count = 0
    start = time.perf_counter()
    with torch.inference_mode():
        out = t.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    seconds = time.perf_counter() - start
    return out[0, ids.shape[1]:].tolist(), seconds, counter.count


def parse_variant(spec: str) -> dict:
    """'hybrid,draft_vocab=32768' -> {"method": "hybrid", "draft_vocab": 32768}: Drafting fields, a bare word is a
    method; values take the type of the field's default."""
    fields = {f.name: f for f in dataclasses.fields(Drafting)}
    out = {}
    for part in filter(None, spec.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            key, value = "method", key
        if key not in fields or key in SERVER_SETTINGS:
            raise SystemExit(f"--variants: {key!r} is not a drafting setting (e.g. method, k, draft_confidence)")
        kind = type(getattr(Drafting(), key))
        out[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return out


def engine_order(repeat: int, with_hf: bool, variants=()) -> list[str]:
    """The engines of one repeat, in running order: reversed on odd repeats, so that drift cancels."""
    order = ["baseline", "speculative", *(f"variant:{v}" for v in variants)] + (list(ENGINES[2:]) if with_hf else [])
    return order[::-1] if repeat % 2 else order


def variant_row(b: RunResult, s: RunResult, hf_speedup: float) -> dict:
    """A speculative configuration's figures against the baseline (and HF assisted) of the same repeat."""
    c = compare(b, s, greedy=True)
    return {"speedup": c.speedup, "ours_vs_hf": c.speedup / hf_speedup, "identical": c.identical,
            "acceptance": s.metrics.acceptance_rate or 0.0,
            "draft_ms_per_token": s.metrics.draft_ms_per_token or NAN}


def bench_prompt(backend, req: Request, counter: PassCounter, order: list[str], variants: dict | None = None) -> dict:
    """One repeat of one prompt: the engines of `order` back to back, and the figures of this repeat."""
    runs = {}
    for engine in order:
        if engine in ("baseline", "speculative"):
            runs[engine] = run_engine(backend, engine, req)
        elif engine.startswith("variant:"):
            runs[engine] = run_engine(backend, "speculative", req.with_drafting(**variants[engine[8:]]))
        else:
            runs[engine] = run_hf(backend, req, engine == "hf_assisted", counter)
    b, s = runs["baseline"], runs["speculative"]
    c = compare(b, s, greedy=True)
    row = {
        "baseline_tps": b.metrics.tokens_per_s,
        "spec_tps": s.metrics.tokens_per_s,
        "speedup": c.speedup,
        "acceptance": s.metrics.acceptance_rate or 0.0,
        "mean_accepted_length": s.metrics.mean_accepted_length or 1.0,
        "bound": NAN if c.machine_bound is None else c.machine_bound,
        "efficiency": NAN if c.efficiency is None else c.efficiency,
        "identical": c.identical,
        "our_target_passes": s.metrics.target_passes,
        "tokens": len(b.output_ids),
        "hf_speedup": NAN, "ours_vs_hf": NAN, "hf_identical": None, "hf_target_passes": None,  # no draft: n/a
    }
    if "hf_assisted" in runs:
        (hf_ids, hf_s, _), (hfa_ids, hfa_s, hfa_passes) = runs["hf"], runs["hf_assisted"]
        hf_speedup = (len(hfa_ids) / hfa_s) / (len(hf_ids) / hf_s)
        row |= {"hf_speedup": hf_speedup, "ours_vs_hf": c.speedup / hf_speedup,
                "hf_identical": first_divergence(b.output_ids, hfa_ids) is None, "hf_target_passes": hfa_passes}
    row["variants"] = {"main": variant_row(b, s, row["hf_speedup"])}
    row["variants"] |= {e[8:]: variant_row(b, r, row["hf_speedup"]) for e, r in runs.items() if e.startswith("variant:")}
    return row


COLUMNS = [
    ("baseline_tps", "base tok/s", "{:.2f}"), ("spec_tps", "spec tok/s", "{:.2f}"), ("speedup", "speedup", "{:.2f}x"),
    ("acceptance", "accept", "{:.2f}"), ("mean_accepted_length", "mean len", "{:.2f}"),
    ("bound", "bound", "{:.2f}x"), ("efficiency", "effic.", "{:.2f}"), ("hf_speedup", "HF asst", "{:.2f}x"),
    ("ours_vs_hf", "ours/HF", "{:.2f}"),
]
WITH_CI = ("speedup", "ours_vs_hf")


def _median(values) -> float:
    """Median of the values that are there (None and NaN are not: e.g. HF figures of a preset without a draft)."""
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(present) if present else NAN


def per_prompt(reps: list[dict]) -> dict:
    """A prompt's figures: the median over repeats of each within-repeat figure, and the machine noise (the
    coefficient of variation of the baseline's tok/s over the repeats; NaN with one repeat)."""
    row = {key: _median(r[key] for r in reps) for key, *_ in COLUMNS}
    tps = [r["baseline_tps"] for r in reps]
    row["noise"] = statistics.stdev(tps) / statistics.mean(tps) if len(tps) > 1 else NAN
    row["identical"] = all(r["identical"] for r in reps)
    row["variants"] = {name: {key: _median(r["variants"][name][key] for r in reps) for key in VARIANT_FIGURES}
                       | {"identical": all(r["variants"][name]["identical"] for r in reps)}
                       for name in reps[0]["variants"]}
    hf = [r["hf_identical"] for r in reps]
    row["hf_identical"] = None if None in hf else all(hf)
    return row


def summarise(prompts: list[dict]) -> dict:
    """A group of prompts: the median over prompts of each figure, a 95 % bootstrap interval over prompts for
    speedup and ours/HF (None where there is no value), and how many prompts kept the baseline's greedy output."""
    row = {key: _median(p[key] for p in prompts) for key in [k for k, *_ in COLUMNS] + ["noise"]}
    for key in WITH_CI:
        values = [p[key] for p in prompts if not math.isnan(p[key])]
        row[key + "_ci"] = bootstrap_ci(values)[1:] if values else None
    row["prompts"] = len(prompts)
    row["identical"] = f"{sum(p['identical'] for p in prompts)}/{len(prompts)}"
    hf = [p["hf_identical"] for p in prompts if p["hf_identical"] is not None]
    row["hf_identical"] = f"{sum(hf)}/{len(hf)}" if hf else "n/a"
    return row


def groups(prompts: list[dict]) -> dict[str, list[dict]]:
    """Rows of the table: each category, each suite that spans several categories, and "all"."""
    rows: dict[str, list[dict]] = {}
    for p in prompts:
        rows.setdefault(p["category"], []).append(p)
    for suite in dict.fromkeys(p["suite"] for p in prompts):
        members = [p for p in prompts if p["suite"] == suite]
        if len({p["category"] for p in members}) > 1:
            rows[suite] = members
    rows["all"] = prompts
    return rows


def _cell(value: float, fmt: str) -> str:
    return "n/a" if value is None or math.isnan(value) else fmt.format(value)


def table(rows: dict[str, dict]) -> str:
    header = ["category", "prompts"] + [h + (" [95% CI]" if k in WITH_CI else "") for k, h, _ in COLUMNS]
    header += ["noise", "identical", "HF ident."]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for name, row in rows.items():
        cells = [name, str(row["prompts"])]
        for key, _, fmt in COLUMNS:
            cell = _cell(row[key], fmt)
            if key in WITH_CI and row[key + "_ci"] is not None:
                low, high = row[key + "_ci"]
                cell += f" [{fmt.format(low).rstrip('x')}, {fmt.format(high).rstrip('x')}]"
            cells.append(cell)
        cells += [_cell(100 * row["noise"], "{:.1f} %"), row["identical"], row["hf_identical"]]
        lines.append(" | ".join(cells))
    return "\n".join("| " + line + " |" for line in lines)


VARIANT_FIGURES = ("speedup", "ours_vs_hf", "acceptance", "draft_ms_per_token")


def with_ci(values: list[float], fmt: str) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    low, high = bootstrap_ci(values)[1:]
    return f"{fmt.format(statistics.median(values))} [{fmt.format(low)}, {fmt.format(high)}]"


def variants_table(prompts: list[dict], names: dict[str, str]) -> str:
    """One row per configuration (the main one first), measured on the same prompts in the same repeats: speedup
    and ours/HF with intervals over all prompts, ours/HF per suite and its lowest category, acceptance and draft
    ms per drafted token (medians over prompts)."""
    suites = list(dict.fromkeys(p["suite"] for p in prompts))
    header = (["configuration", "speedup [95% CI]", "ours/HF [95% CI]"] + [f"ours/HF {s}" for s in suites]
              + ["lowest category (ours/HF)", "accept", "draft ms/token", "identical"])
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for name, label in names.items():
        figures = [p["variants"][name] for p in prompts]
        cells = [label, with_ci([f["speedup"] for f in figures], "{:.2f}"),
                 with_ci([f["ours_vs_hf"] for f in figures], "{:.2f}")]
        cells += [_cell(_median(p["variants"][name]["ours_vs_hf"] for p in prompts if p["suite"] == s), "{:.2f}")
                  for s in suites]
        per_category = {c: _median(p["variants"][name]["ours_vs_hf"] for p in prompts if p["category"] == c)
                        for c in dict.fromkeys(p["category"] for p in prompts)}
        per_category = {c: v for c, v in per_category.items() if not math.isnan(v)}
        lowest = min(per_category, key=per_category.get) if per_category else None
        cells.append(f"{lowest} {per_category[lowest]:.2f}" if lowest else "n/a")
        cells += [_cell(_median(f["acceptance"] for f in figures), "{:.2f}"),
                  _cell(_median(f["draft_ms_per_token"] for f in figures), "{:.1f}"),
                  f"{sum(f['identical'] for f in figures)}/{len(figures)}"]
        lines.append(" | ".join(cells))
    return "\n".join("| " + line + " |" for line in lines)


def describe_prompts(plan: list[tuple[str, SuitePrompt]], seed: int) -> str:
    names = {"humaneval": "HumanEval", "mtbench": "MT-Bench", "ours": "in-repo"}
    parts = []
    for suite in dict.fromkeys(s for s, _ in plan):
        cats = [item.category for s, item in plan if s == suite]
        counts = {c: cats.count(c) for c in cats}
        spread = ""
        if len(counts) > 1:
            per = set(counts.values())
            spread = f" ({per.pop()} per category)" if len(per) == 1 else f" (over {len(counts)} categories)"
        which = f" {', '.join(counts)}" if suite == "ours" else ""
        parts.append(f"{len(cats)} {names[suite]}{which}{spread}")
    sampled = any(s in EXTERNAL_SUITES for s, _ in plan)
    return " + ".join(parts) + (f", sample seed {seed}" if sampled else "")


def add_sample_args(p: argparse.ArgumentParser, mtbench: int = 16) -> None:
    """The arguments of the scripts that run a seeded sample of the external suites (see sample_plan)."""
    p.add_argument("--mtbench-prompts", type=int, default=mtbench, help="MT-Bench prompts sampled (spread over "
                   "categories)")
    p.add_argument("--humaneval-prompts", type=int, default=0, help="HumanEval prompts sampled")
    p.add_argument("--sample-seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)


def sample_plan(args) -> list[tuple[str, SuitePrompt]]:
    """(suite, prompt) pairs from add_sample_args' arguments: HumanEval's sample first, then MT-Bench's."""
    plan = [(suite, item) for suite, n in (("humaneval", args.humaneval_prompts), ("mtbench", args.mtbench_prompts))
            if n > 0 for item in load_external(suite, n, args.sample_seed)]
    if not plan:
        raise SystemExit("no prompts: give --mtbench-prompts and/or --humaneval-prompts above 0")
    return plan


def plan_prompts(args) -> list[tuple[str, SuitePrompt]]:
    """(suite, prompt) pairs: seeded samples of the external suites and/or the first prompts of in-repo categories."""
    cap = (lambda n: n) if args.limit_prompts is None else (lambda n: min(n, args.limit_prompts))
    suites = list(args.suite or (["ours"] if args.categories else EXTERNAL_SUITES))
    if args.categories and "ours" not in suites:
        suites.append("ours")
    plan = []
    for suite in dict.fromkeys(suites):
        if suite == "ours":
            for category in args.categories or categories():
                plan += [("ours", item) for item in load_suite(category)[: cap(args.prompts)]]
        else:
            n = args.humaneval_prompts if suite == "humaneval" else args.mtbench_prompts
            plan += [(suite, item) for item in load_external(suite, cap(n), args.sample_seed)]
    return plan


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    setup()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="qwen-coder", choices=sorted(PRESETS))
    p.add_argument("--suite", action="append", choices=sorted(EXTERNAL_SUITES) + ["ours"],
                   help="repeatable; default: humaneval and mtbench (ours: the in-repo categories)")
    p.add_argument("--humaneval-prompts", type=int, default=24, help="HumanEval prompts sampled")
    p.add_argument("--mtbench-prompts", type=int, default=16, help="MT-Bench prompts sampled, spread evenly over "
                   "its 8 categories (a second turn counts as a prompt)")
    p.add_argument("--sample-seed", type=int, default=0, help="seed of the HumanEval / MT-Bench samples")
    p.add_argument("--categories", nargs="*", help="in-repo categories (implies --suite ours; default: all)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per in-repo category (the first N)")
    p.add_argument("--limit-prompts", type=int, help="quick run: at most N prompts per suite / in-repo category")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--method", choices=METHODS, help="our drafting method (default: the preset's)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--fixed-k", action="store_true", help="constant K instead of dynamic K")
    p.add_argument("--confidence", type=float, default=0.4, help="draft stops below this probability (0 = off)")
    p.add_argument("--no-per-token", action="store_true", help="dynamic K from the i.i.d. model, no per-token stop")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="FR-Spec: our draft model drafts among its N most frequent tokens (0 = all)")
    p.add_argument("--min-rows", type=int, default=MIN_ROWS, help="target passes padded to this many rows (1: none)")
    p.add_argument("--precision", default=AUTO, choices=(AUTO, *PRECISIONS),
                   help="the target's weights (engine.exact.precision; default: the console's, int4 where its kernel\n"
                        "runs); HF runs on the same model object")
    p.add_argument("--variants", nargs="*", default=[], metavar="SETTINGS",
                   help="more speculative configurations, each run on every prompt beside the main one and\n"
                        "compared with the same baseline and HF runs: a method and/or settings of a run,\n"
                        "e.g. --variants hybrid draft_vocab=32768 hybrid,draft_vocab=32768")
    args = p.parse_args(argv)
    variants = {spec: parse_variant(spec) for spec in args.variants}

    try:
        plan = plan_prompts(args)
    except ValueError as e:  # e.g. a suite's package is not installed
        log.error("%s", e)
        return 2
    if not plan:
        log.error("no prompts to run")
        return 2
    backend = LocalBackend.from_preset(args.preset, min_rows=args.min_rows, precision=args.precision)
    counter = PassCounter(backend.target.model)
    method = args.method or PRESETS[args.preset].method
    with_hf = backend.draft is not None
    if with_hf:
        dg = backend.draft.model.generation_config
        log.info("HF assisted generation: num_assistant_tokens=%s schedule=%s confidence=%s",
                 getattr(dg, "num_assistant_tokens", None), getattr(dg, "num_assistant_tokens_schedule", None),
                 getattr(dg, "assistant_confidence_threshold", None))
    else:
        log.info("preset %s has no draft model: HF assisted generation has nothing to draft with (n/a)", args.preset)
    # with --draft-vocab the warm-up also builds the pruned head (and, once per machine, the token ranking)
    warm = Request(prompt="Hello", max_new_tokens=8, drafting=Drafting(method=method, k=args.k,
                                                                       draft_vocab=args.draft_vocab))
    run_engine(backend, "baseline", warm)  # first calls pay one-off costs; also measures the target's step
    run_engine(backend, "speculative", warm)
    for v in variants.values():  # e.g. a pruned draft head is built on its first use
        run_engine(backend, "speculative", warm.with_drafting(**v))

    # greedy whatever temperature the suite gives (Request's default sampling), so outputs can be compared
    drafting = Drafting(method=method, k=args.k, dynamic_k=not args.fixed_k, draft_confidence=args.confidence,
                        per_token=not args.no_per_token, draft_vocab=args.draft_vocab)
    requests = [Request(prompt=item.prompt, earlier_turns=item.earlier_turns, max_new_tokens=args.max_new_tokens,
                        drafting=drafting) for _, item in plan]
    reps: list[list[dict]] = [[] for _ in plan]
    interrupted = False
    try:
        for r in range(args.repeats):
            order = engine_order(r, with_hf, variants)
            for i, ((_, item), req) in enumerate(zip(plan, requests)):
                reps[i].append(bench_prompt(backend, req, counter, order, variants))
                last = reps[i][-1]
                log.info("repeat %d/%d, prompt %d/%d (%s): speedup %.2fx (HF %s), identical=%s", r + 1,
                         args.repeats, i + 1, len(plan), item.category, last["speedup"],
                         _cell(last["hf_speedup"], "{:.2f}x"), last["identical"])
    except KeyboardInterrupt:
        log.warning("interrupted: summarising the repeats completed so far")
        interrupted = True

    prompts = [per_prompt(rs) | {"suite": suite, "category": item.category}
               for (suite, item), rs in zip(plan, reps) if rs]
    if not prompts:
        return 1
    rows = {name: summarise(members) for name, members in groups(prompts).items()}

    kind = "fixed K=%d" % args.k if args.fixed_k else "dynamic K" + ("" if args.no_per_token else ", per-token stop")
    out = sys.stdout
    repeats = f"{args.repeats} repeat{'s' if args.repeats != 1 else ''}"
    repeats += " (interrupted: fewer for some prompts)" if interrupted else ""
    out.write(f"\nPrompts: {describe_prompts(plan, args.sample_seed)}; {repeats}, engine order reversed "
              f"on odd repeats; greedy; {args.max_new_tokens} new tokens; preset {args.preset} "
              f"({backend.precision} target, method {method}, {kind}, confidence floor {args.confidence}, draft "
              f"vocabulary {args.draft_vocab or 'full'}); machine: {machine()}; "
              f"{datetime.date.today().isoformat()}.\n\n")
    out.write(table(rows) + "\n\n")
    out.write("Per prompt the median over repeats of within-repeat figures; per row the median over prompts, with "
              "a 95 % percentile bootstrap interval over prompts (10,000 resamples, seed 0) for speedup and "
              "ours/HF. Noise: coefficient of variation of the baseline's tok/s over repeats (median over "
              "prompts).\n")
    if variants:
        out.write(f"\nConfigurations side by side (each on every prompt, in the same repeats as the table above; "
                  f"main: method {method}, {kind}):\n\n")
        out.write(variants_table(prompts, {"main": "main"} | {v: v for v in variants}) + "\n")
    noise = rows["all"]["noise"]
    if noise > NOISE_WARNING:
        noisy = [name for name, row in rows.items() if row["noise"] > NOISE_WARNING and name != "all"]
        out.write(f"\n> **Warning:** machine noise {100 * noise:.1f} % (above {100 * NOISE_WARNING:.0f} %; "
                  f"noisiest: {', '.join(noisy)}): the machine was busy, rerun on a quiet one.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
