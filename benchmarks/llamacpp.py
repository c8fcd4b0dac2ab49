"""llama.cpp's side of the speed benchmark: its plain decoding, its speculative decoding, and our engines beside it.

    python -m benchmarks.llamacpp                       24 HumanEval + 16 MT-Bench prompts, llama.cpp only
    python -m benchmarks.llamacpp --ours                the same, plus our local engine's baseline and speculative
    python -m benchmarks.llamacpp --humaneval-prompts 4 --mtbench-prompts 4 --repeats 1 --ours   quick check
    python -m benchmarks.llamacpp --ours --fallback   our engine switching speculation off while it loses
    python -m benchmarks.llamacpp --preset smollm2-ngram --spec ngram-simple:k=4:n=2,ngram-mod:k=4   no draft model
    python -m benchmarks.llamacpp --ours --wheel-too    also the xllamacpp wheel's plain decoding, against this build

On the preset's GGUF files (the same files `launch.py --backend llamacpp` loads): a llama.cpp engine without
speculation (llama.cpp plain) and one llama.cpp engine per `--spec` configuration (default: the draft model at
K=4, where the preset has one, and an n-gram type), each its own llama.cpp server, one after the other with all
the machine's cores (engine.llamacpp.backend), served by the llama.cpp the console runs (--llamacpp-server: by
default llama-server built here for this CPU, engine.llamacpp.native). With --ours, our local engine (the preset's
models as the page loads them, the page's default settings) runs its baseline and speculative engines on the same
prompts in the same repeats, so that "ours / llama.cpp plain" is a within-repeat ratio from one run.

Greedy, the chat template, the same token budget for every engine. Within a repeat a prompt runs on every engine
back to back, in the reverse order on odd repeats. Per prompt, each figure is the median over repeats of the figure
measured within a repeat (speedups and "ours / llama.cpp plain" are within-repeat ratios); per category, per suite
and overall the median over prompts, with a 95 % percentile bootstrap interval over prompts for the ratios
(speed.with_ci). Identical: prompts whose greedy output equals llama.cpp plain's in every repeat (ours: equals our
baseline's). Prints markdown tables; nothing here is a test.
"""

from __future__ import annotations

import argparse
import datetime
import io
import logging
import math
import os
import statistics
import sys
from dataclasses import replace
from functools import partial

from benchmarks import bandwidth
from benchmarks.doc_table import machine, machine_kind, write_table
from benchmarks.speed import (NOISE_WARNING, _cell, _median, add_sample_args, describe_prompts, groups, run_engine,
                              sample_plan, with_ci)
from engine.backend import MAX_EXTRA, extra_engine
from engine.exact.precision import AUTO, PRECISIONS
from engine.llamacpp.backend import LlamaCppBackend
from engine.llamacpp.server import (DRAFT_MODEL_METHODS, WHEEL, EngineConfig, LlamaCppError, ServerBuild,
                                    choose_build, parse_method)
from engine.loading.weights import gguf_model
from engine.metrics import compare
from engine.presets import PRESETS
from engine.process.client import EngineProcess
from engine.request import DEFAULT_FALLBACK, Request, build_request
from engine.setup import setup

log = logging.getLogger("benchmarks.llamacpp")

PLAIN = "baseline"  # llama.cpp plain: the backend's baseline engine
OURS = ("ours_baseline", "ours_speculative")
WHEEL_PLAIN = "wheel_plain"  # --wheel-too: the xllamacpp wheel's plain decoding


def ours(preset: str, precision: str, threads: int, on_progress=None):
    """Our engines as the console builds them (run in their engine process), on as many cores as each llama.cpp
    engine."""
    import torch

    from engine.exact.backend import LocalBackend

    torch.set_num_threads(threads)
    return LocalBackend.from_preset(preset, precision=precision, on_progress=on_progress)


def llamacpp_configs(spec: str, target: str, draft: str | None, threads: int) -> list[EngineConfig]:
    """One speculative EngineConfig per `--spec` entry (engine.llamacpp.server.parse_method's syntax)."""
    base = EngineConfig("speculative", target, threads=threads)
    configs = [parse_method(part, base) for part in spec.split(",") if part.strip()]
    if not 1 <= len(configs) <= 1 + MAX_EXTRA:
        raise LlamaCppError(f"--spec takes 1 to {1 + MAX_EXTRA} configurations, got {len(configs)}")
    for c in configs:
        if c.method in DRAFT_MODEL_METHODS and not draft:
            raise LlamaCppError(f"{c.method} drafting needs a draft GGUF, and this preset has no draft model")
    return [replace(c, draft=draft if c.method in DRAFT_MODEL_METHODS else None) for c in configs]


def run(backends: dict, engine: str, req: Request):
    """One engine's run: "baseline" / "speculative" / "speculative-2" ... of llama.cpp, or ours_*."""
    if engine in OURS:
        return run_engine(backends["ours"], engine[5:], req)
    if engine == WHEEL_PLAIN:
        return run_engine(backends["wheel"], PLAIN, req)
    return run_engine(backends["llamacpp"], engine, req)


def policy_words(req: Request) -> str:
    """The drafting policy a request asks for, in a table's words."""
    k = f"dynamic K up to {req.drafting.k_max}" if req.drafting.dynamic_k else f"K {req.drafting.k}"
    confidence = f", draft confidence floor {req.drafting.draft_confidence}" if req.drafting.draft_confidence else ""
    return f"{k}{confidence}, fallback {'on' if req.drafting.fallback else 'off'}"


def bench_prompt(backends: dict, reqs: dict, order: list[str], spec_engines: list[str]) -> dict:
    """One repeat of one prompt: every engine of `order` back to back, and this repeat's figures."""
    runs = {engine: run(backends, engine, reqs["ours" if engine in OURS else "llamacpp"]) for engine in order}
    plain = runs[PLAIN]
    row = {"plain_tps": plain.metrics.tokens_per_s}
    if WHEEL_PLAIN in runs:
        row["wheel"] = {"vs_plain": runs[WHEEL_PLAIN].metrics.tokens_per_s / row["plain_tps"]}
    for engine in spec_engines:
        c = compare(plain, runs[engine], greedy=True)
        row[engine] = {"tps": runs[engine].metrics.tokens_per_s, "speedup": c.speedup,
                       "identical": c.identical, "first_divergence": c.first_divergence,
                       "acceptance": runs[engine].metrics.acceptance_rate}
    if "ours_baseline" in runs:
        ob, os_ = runs["ours_baseline"], runs["ours_speculative"]
        c = compare(ob, os_, greedy=True)
        row["ours"] = {"base_tps": ob.metrics.tokens_per_s, "spec_tps": os_.metrics.tokens_per_s,
                       "speedup": c.speedup, "identical": c.identical,
                       "spec_vs_plain": os_.metrics.tokens_per_s / row["plain_tps"],
                       "base_vs_plain": ob.metrics.tokens_per_s / row["plain_tps"]}
    return row


def per_prompt(reps: list[dict], spec_engines: list[str]) -> dict:
    """A prompt's figures: medians over its repeats, identical only if every repeat was, and the noise (the
    coefficient of variation of llama.cpp plain's tok/s over repeats; NaN with one repeat)."""
    tps = [r["plain_tps"] for r in reps]
    row = {"plain_tps": statistics.median(tps),
           "noise": statistics.stdev(tps) / statistics.mean(tps) if len(tps) > 1 else math.nan}
    for name in spec_engines + [extra for extra in ("ours", "wheel") if extra in reps[0]]:
        figures = [r[name] for r in reps]
        row[name] = {key: _median(f[key] for f in figures) for key in figures[0]
                     if key not in ("identical", "first_divergence")}
        if name != "wheel":
            row[name]["identical"] = all(f["identical"] for f in figures)
        if name in spec_engines:
            divergences = [f["first_divergence"] for f in figures if f["first_divergence"] is not None]
            row[name]["first_divergence"] = min(divergences) if divergences else None
    return row


def by_spell(repeats: list[dict], ours: bool) -> str:
    """The memory bandwidth the repeats ran at, and, where the machine had slow and fast spells, each spell's
    figures over the repeats that ran within it (benchmarks.bandwidth)."""
    readings = [r["bandwidth"] for r in repeats]
    if not readings:
        return ""
    threshold = bandwidth.split(readings)
    text = (f"Memory bandwidth (a {bandwidth.PROBE_MIB} MiB read before and after each prompt's repeat): "
            f"{min(map(min, readings)):.0f}-{max(map(max, readings)):.0f} GB/s")
    if threshold is None:
        changed = sum(not bandwidth.steady(r) for r in readings)
        return text + (", one spell." if changed < len(readings) else ": every repeat changed spell while it ran.")
    lines = [text + f": slow and fast spells (split at {threshold:.0f} GB/s). Per spell, over the repeats that ran "
                    "within one (median over repeats [95 % bootstrap interval]):", ""]
    for name in ("slow", "fast"):
        within = [r for r in repeats if bandwidth.spell(r["bandwidth"], threshold) == name]
        if not within:
            continue
        line = (f"- {name}: {len(within)} repeats, llama.cpp plain {_median(r['plain_tps'] for r in within):.2f} "
                "tok/s")
        if ours:
            for engine, key in (("speculative", "spec_vs_plain"), ("baseline", "base_vs_plain")):
                line += f", ours {engine} / llama.cpp plain {with_ci([r['ours'][key] for r in within], '{:.2f}')}"
        lines.append(line)
    mixed = sum(bandwidth.spell(r["bandwidth"], threshold) == "mixed" for r in repeats)
    lines.append(f"- {mixed} repeats changed spell while they ran")
    return "\n".join(lines)


def identical(prompts: list[dict], name: str) -> str:
    return f"{sum(p[name]['identical'] for p in prompts)} of {len(prompts)}"


def llamacpp_table(rows: dict[str, list[dict]], spec_engines: list[str], labels: dict[str, str]) -> str:
    header = ["category", "prompts", "llama.cpp plain tok/s"]
    for engine in spec_engines:
        header += [f"{labels[engine]} tok/s", f"{labels[engine]} speedup [95% CI]", "accept", "identical"]
    header.append("noise")
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for name, prompts in rows.items():
        cells = [name, str(len(prompts)), _cell(_median(p["plain_tps"] for p in prompts), "{:.2f}")]
        for engine in spec_engines:
            cells += [_cell(_median(p[engine]["tps"] for p in prompts), "{:.2f}"),
                      with_ci([p[engine]["speedup"] for p in prompts], "{:.2f}"),
                      _cell(_median(p[engine]["acceptance"] for p in prompts), "{:.2f}"),
                      identical(prompts, engine)]
        cells.append(_cell(100 * _median(p["noise"] for p in prompts), "{:.1f} %"))
        lines.append(" | ".join(cells))
    return "\n".join("| " + line + " |" for line in lines)


def ours_table(rows: dict[str, list[dict]]) -> str:
    header = ["category", "prompts", "ours baseline tok/s", "ours speculative tok/s", "ours speedup [95% CI]",
              "ours identical", "ours speculative / llama.cpp plain [95% CI]",
              "ours baseline / llama.cpp plain [95% CI]"]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for name, prompts in rows.items():
        o = [p["ours"] for p in prompts]
        lines.append(" | ".join([
            name, str(len(prompts)), _cell(_median(f["base_tps"] for f in o), "{:.2f}"),
            _cell(_median(f["spec_tps"] for f in o), "{:.2f}"), with_ci([f["speedup"] for f in o], "{:.2f}"),
            identical(prompts, "ours"), with_ci([f["spec_vs_plain"] for f in o], "{:.2f}"),
            with_ci([f["base_vs_plain"] for f in o], "{:.2f}")]))
    return "\n".join("| " + line + " |" for line in lines)


def divergences(prompts: list[dict], plan, spec_engines: list[str], labels: dict[str, str]) -> list[str]:
    """One line per llama.cpp configuration whose greedy output left llama.cpp plain's: where, on which prompts."""
    out = []
    for engine in spec_engines:
        parted = [(item.category, p[engine]["first_divergence"]) for (_, item), p in zip(plan, prompts)
                  if not p[engine]["identical"]]
        if parted:
            out.append(f"{labels[engine]}: {len(parted)} of {len(prompts)} prompts diverge from llama.cpp plain, "
                       "first divergent token " + ", ".join(f"{c} @{d}" for c, d in parted))
    return out


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the progress
    setup()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="qwen-coder", choices=sorted(PRESETS))
    add_sample_args(p)
    p.set_defaults(humaneval_prompts=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--spec", help="llama.cpp speculative configurations, comma-separated, as --llamacpp-compare "
                                  "takes them: method[:k=N][:n_min=N][:p_min=X][:n=N] (default: draft:k=4 where the "
                                  "preset has a draft model, and ngram-simple:k=4:n=3)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of each llama.cpp engine and of our engine (torch); on a machine that other work\n"
                        "shares, 1: a thread that waits for a core slows its engine down, where several threads\n"
                        "that wait for each other make llama.cpp's plain decoding collapse")
    p.add_argument("--ours", action="store_true", help="also run our local engine's baseline and speculative")
    p.add_argument("--precision", default=AUTO, choices=(AUTO, *PRECISIONS),
                   help="our target's weights (--ours); default: the console's (int4 where its kernel runs)")
    p.add_argument("--llamacpp-server", default="auto", metavar="auto|wheel|PATH",
                   help="which llama.cpp serves llama.cpp's engines, as launch.py takes it (default: built here)")
    p.add_argument("--wheel-too", action="store_true",
                   help="also the xllamacpp wheel's plain decoding: wheel / this build, per prompt")
    p.add_argument("--no-docs", action="store_true", help="print only; by default the table also replaces this "
                                                          "machine's and configuration's own in docs/llamacpp.md")
    p.add_argument("--fallback", action=argparse.BooleanOptionalAction, default=DEFAULT_FALLBACK,
                   help="our speculative engine switches speculation off while it does not pay (--ours; default: the "
                        "console's, docs/policy.md)")
    args = p.parse_args(argv)

    preset = PRESETS[args.preset]
    plan = sample_plan(args)
    spec = args.spec or ("draft:k=4," if preset.draft else "") + "ngram-simple:k=4:n=3"
    target = str(gguf_model(preset.target)[0])
    draft = str(gguf_model(preset.draft)[0]) if preset.draft else None
    try:
        configs = llamacpp_configs(spec, target, draft, args.threads)
    except LlamaCppError as e:
        log.error("%s", e)
        return 2
    build = choose_build(args.llamacpp_server, model=target)
    backends = {"llamacpp": LlamaCppBackend.managed(configs[0], configs[1:], build=build)}
    try:
        spec_engines = ["speculative", *(extra_engine(i) for i in range(len(configs) - 1))]
        labels = {engine: c.label() for engine, c in zip(spec_engines, configs)}
        engines = [PLAIN, *spec_engines]
        if args.wheel_too:
            backends["wheel"] = LlamaCppBackend.managed(configs[0], build=ServerBuild(None, WHEEL))
            engines.append(WHEEL_PLAIN)
        ours_base = None
        if args.ours:  # in its engine process, as the console runs it
            # the factory by its module's name: run as `-m`, this module is __main__, which the engine process is not
            from benchmarks.llamacpp import ours as factory

            backends["ours"] = EngineProcess(partial(factory, args.preset, args.precision, args.threads)).start()
            # the page's defaults (dynamic K, the draft's confidence floor, ...) for the preset's method
            ours_base = build_request("-", max_new_tokens=args.max_new_tokens, method=preset.method,
                                      fallback=args.fallback)
            warm = replace(ours_base, prompt="Hello", max_new_tokens=8)
            for engine in ("baseline", "speculative"):  # first calls pay one-off costs
                run_engine(backends["ours"], engine, warm)
            engines += list(OURS)
        reps: list[list[dict]] = [[] for _ in plan]
        probe = bandwidth.Probe()
        interrupted = False
        try:
            for r in range(args.repeats):
                order = engines[::-1] if r % 2 else engines
                for i, (_, item) in enumerate(plan):
                    req = Request(prompt=item.prompt, earlier_turns=item.earlier_turns,
                                  max_new_tokens=args.max_new_tokens)  # greedy: Request's default sampling
                    ours = ours_base and replace(ours_base, prompt=item.prompt, earlier_turns=item.earlier_turns)
                    before = probe.gbs()
                    last = bench_prompt(backends, {"llamacpp": req, "ours": ours}, order, spec_engines)
                    last["bandwidth"] = (before, probe.gbs())
                    reps[i].append(last)
                    log.info("repeat %d/%d, prompt %d/%d (%s): plain %.2f tok/s, %s", r + 1, args.repeats, i + 1,
                             len(plan), item.category, last["plain_tps"],
                             ", ".join(f"{labels[e]} {last[e]['speedup']:.2f}x" for e in spec_engines)
                             + (f", ours spec/plain {last['ours']['spec_vs_plain']:.2f}" if "ours" in last else ""))
        except KeyboardInterrupt:
            log.warning("interrupted: summarising the repeats completed so far")
            interrupted = True
    finally:
        for backend in backends.values():
            backend.close()

    done = [(entry, rs) for entry, rs in zip(plan, reps) if rs]
    if not done:
        return 1
    prompts = [per_prompt(rs, spec_engines) | {"suite": suite, "category": item.category}
               for (suite, item), rs in done]
    rows = groups(prompts)
    out = io.StringIO()
    config = (f"preset {args.preset}, llama.cpp {'built here' if not build.wheel else 'wheel'}"
              f"{', ours ' + args.precision if args.ours else ''}")
    command = "python -m benchmarks.llamacpp" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    out.write(f"#### {machine_kind()}: {config}\n\n`{command}`\n\nllama.cpp: {build.description}\n")
    if args.wheel_too:
        import xllamacpp

        out.write(f"The wheel beside it: xllamacpp {getattr(xllamacpp, '__version__', '?')}, CPU features "
                  f"{xllamacpp.get_system_info().strip()}; wheel plain / this build's plain over all prompts: "
                  f"{with_ci([p['wheel']['vs_plain'] for p in prompts], '{:.2f}')}\n")
    repeats = f"{args.repeats} repeat{'s' if args.repeats != 1 else ''}"
    repeats += " (interrupted: fewer for some prompts)" if interrupted else ""
    out.write(f"\nPrompts: {describe_prompts(plan, args.sample_seed)}; {repeats}, engine order reversed on odd "
              f"repeats; greedy; {args.max_new_tokens} new tokens; preset {args.preset} GGUF files "
              f"({os.path.basename(target)}{', draft ' + os.path.basename(draft) if draft else ''}); every engine "
              f"{args.threads} thread{'s' if args.threads != 1 else ''}, one at a time; machine: {machine()}; "
              f"{datetime.date.today().isoformat()}.\n\n")
    out.write(llamacpp_table(rows, spec_engines, labels) + "\n\n")
    if args.ours:
        out.write(f"Our local engine on the same prompts in the same repeats (preset {args.preset}, method "
                  f"{preset.method}, target weights {args.precision}, the page's default settings: "
                  f"{policy_words(ours_base)}):\n\n" + ours_table(rows) + "\n\n")
        o = [p["ours"] for p in prompts]
        out.write(f"From this one run, over all {len(prompts)} prompts: ours speculative / llama.cpp plain "
                  f"{with_ci([f['spec_vs_plain'] for f in o], '{:.2f}')}; ours baseline / llama.cpp plain "
                  f"{with_ci([f['base_vs_plain'] for f in o], '{:.2f}')}.\n\n")
    out.write(by_spell([r for _, rs in done for r in rs], args.ours) + "\n\n")
    for line in divergences(prompts, [entry for entry, _ in done], spec_engines, labels):
        out.write(f"- {line}\n")
    out.write("\nPer prompt the median over repeats of within-repeat figures; per row the median over prompts, with "
              "a 95 % percentile bootstrap interval over prompts (10,000 resamples, seed 0) for the ratios. "
              "Identical: prompts whose greedy output matched the baseline's in every repeat. Noise: coefficient of "
              "variation of llama.cpp plain's tok/s over repeats (median over prompts).\n")
    noise = _median(p["noise"] for p in prompts)
    if noise > NOISE_WARNING:
        out.write(f"\n> **Warning:** machine noise {100 * noise:.1f} % (above {100 * NOISE_WARNING:.0f} %): the "
                  "machine was busy, rerun on a quiet one.\n")
    sys.stdout.write(out.getvalue())
    if not args.no_docs and not interrupted:
        path = write_table("llamacpp.md", f"llamacpp / {machine_kind()} / {config}", out.getvalue())
        log.info("table written in %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
