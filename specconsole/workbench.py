"""Suites and sweeps: many prompts on both engines, every run saved under one suite id, and the aggregates.

A suite can run each prompt several times (repeats, interleaved, alternating which engine goes first); the
aggregates count each prompt once, with the median of its repeats, and give the speedup a 95 % bootstrap interval
over prompts (engine/analysis/stats.py), which is what the advisor decides from.

A sweep changes one variable at a time: K (1..8 and dynamic), temperature, drafting method, context length
(short prompt vs the same prompt after a long document), or, on the vLLM backend, concurrency (parallel requests
through httpx async, measured as aggregate throughput).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import mean, median, stdev
from typing import Callable

import pandas as pd
from tqdm import tqdm

from engine.comparison import ComparisonFigures
from engine.limits import (MAX_CONCURRENCY, MAX_PROMPTS_PER_SUITE, MAX_REPEATS, MAX_SWEEP_VALUES,
                           MAX_TEMPERATURE, SettingsError, check_range, number)
from engine.llamacpp.server import METHODS as LLAMACPP_METHODS
from engine.methods import METHODS
from engine.request import Request
from engine.run_metrics import RunMetrics
from engine.analysis.stats import bootstrap_ci, ratio_ci
from engine.vllm.config import METHODS as VLLM_METHODS
from specconsole.advisor import Advice, ab_conclusion, advise
from specconsole.history import History
from engine.backend import ENGINES, K_RANGE
from engine.drafting import Drafting
from specconsole.runner import Comparison, run_meta as runner_meta
from specconsole.suites import SuitePrompt

log = logging.getLogger(__name__)

SWEEPS = {
    "none": [""],
    "k": ["1", "2", "4", "8", "dynamic"],
    "temperature": ["0", "0.4", "0.8", "1.2"],
    "method": list(METHODS),  # with the vLLM backend: its methods, e.g. ngram,draft_model,eagle
    "context": ["short", "long"],
    "concurrency": ["1", "2", "4", "8", "16"],
}
LONG_DOCUMENT = (Path(__file__).resolve().parent.parent / "assets" / "long_document.txt")


def check_plan(variable: str, values: list[str] | None, repeats: int = 1, prompts_per_suite: int | None = None,
               methods: tuple[str, ...] = METHODS + VLLM_METHODS + tuple(LLAMACPP_METHODS),
               k_range: tuple[int, int] = K_RANGE) -> list[str]:
    """A suite's shape against engine.limits, before anything is loaded or run: the repeats, the prompts per suite,
    the number of sweep values and each value (`methods`, `k_range`: the methods the backend can sweep and the K it
    drafts, Capabilities.k_range). Returns the values (the sweep's usual ones when none are given); SettingsError
    names the first value out of range."""
    if variable not in SWEEPS:
        raise SettingsError(f"unknown sweep {str(variable)[:40]!r}; sweeps: {', '.join(SWEEPS)}")
    check_range("repeats", repeats, 1, MAX_REPEATS, "more repeats add little to the noise estimate; run a second "
                "suite instead")
    if prompts_per_suite is not None:
        check_range("prompts per suite", prompts_per_suite, 1, MAX_PROMPTS_PER_SUITE, "run a sample of the suite")
    values = values or SWEEPS[variable]
    check_range("the number of sweep values", len(values), 1, MAX_SWEEP_VALUES, "sweep fewer values at a time")
    for value in values:
        what = f"a sweep value of {'K' if variable == 'k' else variable}"
        if variable == "k" and value != "dynamic":
            check_range(what, number(f"{what} (or dynamic)", value), *k_range)
        elif variable == "temperature":
            check_range(what, number(what, value, float), 0.0, MAX_TEMPERATURE)
        elif variable == "concurrency":
            check_range(f"{what} (parallel requests)", number(what, value), 1, MAX_CONCURRENCY,
                        "beyond it the servers only queue the requests")
        elif variable in ("method", "context"):
            choices = methods if variable == "method" else SWEEPS[variable]
            if value not in choices:
                raise SettingsError(f"{what} must be one of {', '.join(choices)}, got {value[:40]!r}")
    return values


def server_drafting(backend) -> bool:
    """Whether drafting is the speculative engine's own (vLLM, llama.cpp): a method or K sweep restarts it."""
    return not backend.capabilities.per_request_drafting


def sweep_methods(backend) -> tuple[str, ...]:
    """The values a method sweep can take on this backend."""
    return backend.capabilities.methods if server_drafting(backend) else METHODS


def default_values(backend, variable: str) -> list[str]:
    """A sweep's values when none are given: SWEEPS', less what the backend cannot run (a K outside the K it drafts,
    dynamic K where the engine drafts a fixed K), or the methods the backend sweeps by default."""
    if variable == "k":
        low, high = backend.capabilities.k_range
        fixed = [v for v in SWEEPS["k"] if v != "dynamic" and low <= int(v) <= high]
        return fixed if server_drafting(backend) else [*fixed, "dynamic"]
    if variable == "method" and server_drafting(backend):
        return list(backend.capabilities.sweep_methods)
    return list(SWEEPS.get(variable, [""]))


def served_drafting(backend, variable: str, value: str) -> Drafting:
    """What backend.reconfigure() takes to serve one value of a method or K sweep: the served drafting with that
    method (and the served K) or that K."""
    served = backend.drafting()  # a backend that can restart its server knows what it serves
    if variable == "method":
        return Drafting(value, served.k, served.draft)
    return replace(served, k=int(value))


def request_for(base: Request, item: SuitePrompt, variable: str = "none", value: str = "",
                suite_temperature: bool = True) -> Request:
    """The request for one suite prompt at one sweep value."""
    sampling = replace(base.sampling, temperature=item.temperature) if suite_temperature else base.sampling
    req = replace(base, prompt=item.prompt, earlier_turns=item.earlier_turns, sampling=sampling)
    if variable == "k":
        k = {"dynamic_k": True, "k": 4} if value == "dynamic" else {"dynamic_k": False, "k": int(value)}
        return req.with_drafting(**k)
    if variable == "temperature":
        return replace(req, sampling=replace(req.sampling, temperature=float(value)))
    if variable == "method" and value in METHODS:  # vLLM's methods live in its speculative server
        return req.with_drafting(method=value)
    if variable == "context" and value == "long":
        document = LONG_DOCUMENT.read_text()
        return replace(req, prompt=f"Background document:\n{document}\n\nTask: {item.prompt}")
    return req


@dataclass
class SuiteRun:
    suite_id: str
    run_ids: list[str] = field(default_factory=list)
    cancelled: bool = False


def run_suite(backend, items: list[SuitePrompt], base: Request, history: History, meta: dict, mode: str = "fair",
              variable: str = "none", values: list[str] | None = None, suite_temperature: bool = True,
              cancel: threading.Event | None = None, on_progress: Callable | None = None,
              suite_id: str | None = None, repeats: int = 1) -> SuiteRun:
    """Every prompt (at every sweep value) on both engines, `repeats` times, one comparison after the other.

    Repeats are interleaved (repeat 1 of every prompt, then repeat 2, ...) and the engine that goes first alternates
    from one repeat to the next and from one prompt to the next, so that drift in the machine's speed (heat, other
    work) falls on both engines alike instead of on whichever always ran first.

    Where drafting is the speculative engine's own (vLLM, llama.cpp), a method or K sweep restarts it with each
    value, and afterwards with the settings it had before."""
    if variable == "concurrency":
        raise ValueError("the concurrency sweep runs through concurrency_sweep (vLLM backend)")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    restart = variable in ("method", "k") and server_drafting(backend)
    if restart and not backend.capabilities.can_reconfigure:
        raise ValueError(f"a {variable} sweep restarts the speculative engine with each value: only engines the "
                         "console started can be restarted (these were attached)")
    values = values or default_values(backend, variable)
    suite = SuiteRun(suite_id or "s" + uuid.uuid4().hex[:9])  # never read back as a number (history.start_run)
    plan = [(item_index, item, value, repeat) for value in values for repeat in range(repeats)
            for item_index, item in enumerate(items)]
    bar = tqdm(total=len(plan), desc=f"suite {suite.suite_id}", unit="run")
    before = backend.drafting() if restart else None
    served = None
    try:
        for i, (item_index, item, value, repeat) in enumerate(plan):
            if cancel is not None and cancel.is_set():
                suite.cancelled = True
                break
            if restart and value != served:
                backend.reconfigure(served_drafting(backend, variable, value))
                served = value
            req = request_for(base, item, variable, value, suite_temperature and variable != "temperature")
            # what actually ran (runner.run_meta): after a reconfigure, the server's new method
            run_meta = meta | runner_meta(backend, req) | {
                "category": item.category, "suite_id": suite.suite_id, "repeat": repeat,
                "sweep_variable": None if variable == "none" else variable, "sweep_value": value or None}
            comp = Comparison(backend, req, mode, history, run_meta, first=ENGINES[(item_index + repeat) % 2])
            comp.start()
            while not comp.poll(0.1):
                if cancel is not None and cancel.is_set():
                    comp.cancel.set()  # this run is saved as cancelled; the ones before it stay complete
            suite.run_ids.append(comp.run_id)
            bar.update(1)
            if on_progress:
                note = f" (repeat {repeat + 1} of {repeats})" if repeats > 1 else ""
                on_progress(i + 1, len(plan), f"{item.category}{note}: {item.prompt[:60]}")
    finally:
        bar.close()
        if served is not None and backend.drafting() != before:
            backend.reconfigure(before)  # the console serves the settings it had before the sweep
    suite.cancelled = suite.cancelled or (cancel is not None and cancel.is_set())
    return suite


# --- aggregates --------------------------------------------------------------------------------------------------
# The statistic is engine/analysis/stats.py's: per prompt the median over its repeats, then the median over prompts, with a
# 95 % bootstrap interval over prompts for the speedup.


def _prompt_id(prompt: str, settings: str | None) -> str:
    """Which suite prompt a run was: its text and earlier turns (the same in every suite, so A/B runs pair up)."""
    turns = json.loads(settings or "{}").get("earlier_turns") or []
    return hashlib.sha1(json.dumps([prompt, turns]).encode()).hexdigest()[:10]


def runs_frame(history: History, suite_id: str) -> pd.DataFrame:
    """One row per stored run of a suite, with the figures the aggregates are built from."""
    rows = []
    metrics = history.suite_metrics(suite_id)
    for run in history.runs(suite_id=suite_id, limit=1_000_000):
        b = metrics.get(run["id"], {}).get("baseline") or RunMetrics()
        s = metrics.get(run["id"], {}).get("speculative") or RunMetrics()
        saved = json.loads(run["comparison"] or "{}")  # the figures, and the sampling check beside them
        c = ComparisonFigures.from_dict(saved)
        total_ms = 1000 * s.output_tokens / s.tokens_per_s if s.tokens_per_s else None
        rows.append({
            "run_id": run["id"], "category": run["category"], "status": run["status"], "method": run["method"],
            "prompt_id": _prompt_id(run["prompt"] or "", run["settings"]), "prompt": (run["prompt"] or "")[:100],
            "repeat": run["repeat"], "sweep_variable": run["sweep_variable"], "sweep_value": run["sweep_value"] or "",
            "speedup": c.speedup, "decode_speedup": c.decode_speedup,
            "baseline_tps": b.tokens_per_s, "speculative_tps": s.tokens_per_s,
            "acceptance": s.acceptance_rate, "alpha": c.alpha,
            "mean_accepted_length": s.mean_accepted_length,
            "per_position": s.per_position_acceptance or [],
            "histogram": s.acceptance_histogram,  # None: the backend could not place the steps
            "ttft_ms_baseline": b.ttft_ms, "ttft_ms_speculative": s.ttft_ms,
            "tpot_ms_baseline": b.tpot_ms, "tpot_ms_speculative": s.tpot_ms,
            "prefill_share": (s.prefill_ms or 0) / total_ms if total_ms else None,
            "machine_bound": c.machine_bound, "efficiency": c.efficiency,
            "identical": c.identical, "sampling_check": saved.get("sampling_check"),
            "first_divergence": c.first_divergence,
            "divergence_margin": c.divergence_margin,  # the plain pass's margin there (engine.metrics.near_tie)
            # why this backend's greedy output can part from the baseline's (llama.cpp), where it did
            "divergence_note": s.divergence_note if c.identical is False else None,
        })
    return pd.DataFrame(rows)


def _histogram(histograms) -> dict:
    """A category's speculative steps by drafts accepted (engine.metrics' acceptance_histogram), summed over its
    runs, and the share that accepted nothing; None where any run's steps could not be placed (unknown, not 0)."""
    histograms = list(histograms)
    if not histograms or any(h is None or h != h for h in histograms):
        return {"histogram": None, "steps_accepting_nothing": None}
    width = max((len(h) for h in histograms), default=0)
    total = [sum(h[i] for h in histograms if len(h) > i) for i in range(width)]
    return {"histogram": total, "steps_accepting_nothing": total[0] / sum(total) if sum(total) else None}


def _present(values) -> list:
    return [v for v in values if v is not None and v == v]  # v == v drops NaN


def _med(values) -> float | None:
    values = _present(values)
    return median(values) if values else None


def prompt_medians(runs: pd.DataFrame, column: str) -> dict[str, float]:
    """prompt_id -> the median of `column` over that prompt's repeats (prompts without a value are left out)."""
    out = {pid: _med(g[column]) for pid, g in runs.groupby("prompt_id", sort=True)}
    return {pid: v for pid, v in out.items() if v is not None}


def _cv(values) -> float | None:
    """Coefficient of variation (sample standard deviation / mean); None with fewer than two values."""
    values = _present(values)
    return stdev(values) / mean(values) if len(values) >= 2 and mean(values) else None


def _suspects(verdicts) -> str:
    checked = [v for v in verdicts if v in ("ok", "suspect")]
    return f"{checked.count('suspect')} suspect of {len(checked)}" if checked else ""


def aggregate(runs: pd.DataFrame) -> pd.DataFrame:
    """Per category (and sweep value), over the completed runs: the median speedup over prompts with its 95 %
    bootstrap interval, the other figures as medians over prompts (each prompt's median over its repeats), and the
    machine's noise: the baseline's tokens/s coefficient of variation over repeats of one prompt (median over
    prompts; None without repeats)."""
    if runs.empty:
        return pd.DataFrame()
    done = runs[runs["status"] == "completed"]
    rows = []
    for (category, value), g in done.groupby(["category", "sweep_value"], sort=True):
        per_prompt = prompt_medians(g, "speedup")
        speedups = list(per_prompt.values())
        point, low, high = bootstrap_ci(speedups) if speedups else (None, None, None)
        positions = [p for p in g["per_position"] if p]
        width = max((len(p) for p in positions), default=0)
        methods = sorted(set(_present(g["method"])))
        noise = [_cv(repeats["baseline_tps"]) for _, repeats in g.groupby("prompt_id")]
        med = lambda column: _med(prompt_medians(g, column).values())  # noqa: E731 - median over prompts
        rows.append({
            "category": category, "sweep_value": value, "method": methods[0] if len(methods) == 1 else ("mixed" if methods else None),
            "prompts": len(speedups), "runs": len(g),
            "speedup": point, "speedup_low": low, "speedup_high": high,
            "speedup_min": min(speedups, default=None), "speedup_max": max(speedups, default=None),
            "prompt_speedups": [per_prompt[p] for p in sorted(per_prompt)],
            "noise_cv": _med(noise), "baseline_tps": med("baseline_tps"), "speculative_tps": med("speculative_tps"),
            "acceptance": med("acceptance"), "alpha": med("alpha"), "mean_accepted_length": med("mean_accepted_length"),
            "per_position": [_med([p[i] for p in positions if len(p) > i]) for i in range(width)],
            **_histogram(g.get("histogram", [])),
            "ttft_ms_baseline": med("ttft_ms_baseline"), "ttft_ms_speculative": med("ttft_ms_speculative"),
            "tpot_ms_baseline": med("tpot_ms_baseline"), "tpot_ms_speculative": med("tpot_ms_speculative"),
            "prefill_share": med("prefill_share"), "machine_bound": med("machine_bound"),
            "efficiency": med("efficiency"),
            "identical": f"{sum(v is True for v in g['identical'])}/{sum(v is not None for v in g['identical'])}",
            # greedy runs that parted from the baseline, and the median logit margin where they did: near 0,
            # a near-tie that passes of another shape round apart
            "divergences": sum(v is False for v in g["identical"]),
            "divergence_margin": _med(g.get("divergence_margin", [])),
            "divergence_note": next(iter(_present(g.get("divergence_note", []))), None),
            # sampled runs: how many the sampling check (engine.analysis.check) found suspect, of those it checked
            "sampling_check": _suspects(g.get("sampling_check", [])),
        })
    return pd.DataFrame(rows)


def ab_compare(runs_a: pd.DataFrame, runs_b: pd.DataFrame) -> pd.DataFrame:
    """Per category (and sweep value) of two suites: the ratio B/A of their speedups with its 95 % interval and a
    one-line conclusion. Paired by prompt where both suites ran the same prompts (each prompt is its own control);
    otherwise the ratio of the two medians, each suite resampled on its own."""
    def groups(runs):
        if runs.empty:
            return {}
        done = runs[runs["status"] == "completed"]
        return {key: prompt_medians(g, "speedup") for key, g in done.groupby(["category", "sweep_value"], sort=True)}

    a, b = groups(runs_a), groups(runs_b)
    rows = []
    for key in sorted(set(a) | set(b)):
        pa, pb = a.get(key, {}), b.get(key, {})
        row = {"category": key[0], "sweep_value": key[1], "prompts A": len(pa), "prompts B": len(pb),
               "speedup A": _med(pa.values()), "speedup B": _med(pb.values()),
               "ratio": None, "ratio_low": None, "ratio_high": None, "paired": False}
        if not pa or not pb:
            row["conclusion"] = f"only suite {'A' if pa else 'B'} ran {key[0]}"
        else:
            paired = set(pa) == set(pb)
            ids = sorted(pa)
            point, low, high = (ratio_ci([pa[i] for i in ids], [pb[i] for i in ids], paired=True) if paired
                                else ratio_ci(list(pa.values()), list(pb.values()), paired=False))
            row.update(ratio=point, ratio_low=low, ratio_high=high, paired=paired,
                       conclusion=ab_conclusion(point, low, high, min(len(pa), len(pb))))
        rows.append(row)
    return pd.DataFrame(rows)


def advice_for(backend, agg: pd.DataFrame, variable: str | None, concurrency: pd.DataFrame | None = None) -> list[Advice]:
    """The advisor's verdicts, with the backend's memory figures where it has them (the local backend)."""
    if agg.empty:
        return []
    return advise(agg, variable, memory=backend.memory(), concurrency=concurrency)


# --- concurrency (vLLM) ------------------------------------------------------------------------------------------


def concurrency_sweep(backend, items: list[SuitePrompt], levels: list[int], max_new_tokens: int,
                      on_progress: Callable | None = None, cancel: threading.Event | None = None) -> pd.DataFrame:
    """Aggregate tokens/s of both vLLM servers at each number of parallel requests: where speculation stops paying.
    `cancel` stops it within the burst in flight; the levels measured before it are kept, that one is dropped."""
    if not backend.capabilities.concurrent_requests:
        raise ValueError("the concurrency sweep needs the vLLM backend (in-process engines serve one request)")
    for level in levels:  # a caller that skipped check_plan still never builds a burst over the limit
        check_range("concurrency", level, 1, MAX_CONCURRENCY)
    columns = ["concurrency", "baseline_tps", "speculative_tps", "speedup"]
    stopped = lambda: cancel is not None and cancel.is_set()  # noqa: E731
    rows = []
    for i, level in enumerate(levels):
        prompts = [items[j % len(items)].prompt for j in range(level)]
        row = {"concurrency": level}
        for engine in ("baseline", "speculative"):
            if stopped():
                break
            tokens, seconds = backend.throughput(engine, prompts, max_new_tokens, cancel)
            row[f"{engine}_tps"] = tokens / seconds
        if stopped():
            break
        row["speedup"] = row["speculative_tps"] / row["baseline_tps"]
        rows.append(row)
        if on_progress:
            on_progress(i + 1, len(levels), f"concurrency {level}")
    return pd.DataFrame(rows, columns=columns)
