"""Suites and sweeps: many prompts on both engines, every run saved under one suite id, and the aggregates.

A sweep changes one variable at a time: K (1..8 and dynamic), temperature, drafting method, context length
(short prompt vs the same prompt after a long document), or, on the vLLM backend, concurrency (parallel requests
through httpx async, measured as aggregate throughput).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import median
from typing import Callable

import httpx
import pandas as pd
from tqdm import tqdm

from engine.backend import Request
from engine.models import chat_messages
from specconsole.advisor import Advice, advise
from engine.vllm_backend import speculative_config
from specconsole.history import History
from specconsole.runner import Comparison
from specconsole.suites import SuitePrompt

log = logging.getLogger(__name__)

SWEEPS = {
    "none": [""],
    "k": ["1", "2", "4", "8", "dynamic"],
    "temperature": ["0", "0.4", "0.8", "1.2"],
    "method": ["draft", "ngram"],  # with the vLLM backend: its methods, e.g. ngram,draft_model,eagle
    "context": ["short", "long"],
    "concurrency": ["1", "2", "4", "8", "16"],
}
LONG_DOCUMENT = (Path(__file__).resolve().parent.parent / "assets" / "long_document.txt")


def request_for(base: Request, item: SuitePrompt, variable: str = "none", value: str = "",
                suite_temperature: bool = True) -> Request:
    """The request for one suite prompt at one sweep value."""
    sampling = replace(base.sampling, temperature=item.temperature) if suite_temperature else base.sampling
    req = replace(base, prompt=item.prompt, earlier_turns=item.earlier_turns, sampling=sampling)
    if variable == "k":
        return replace(req, dynamic_k=True, k=4) if value == "dynamic" else replace(req, dynamic_k=False, k=int(value))
    if variable == "temperature":
        return replace(req, sampling=replace(req.sampling, temperature=float(value)))
    if variable == "method" and value in ("draft", "ngram"):  # vLLM's methods live in its speculative server
        return replace(req, method=value)
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
              suite_id: str | None = None) -> SuiteRun:
    """Every prompt (at every sweep value) on both engines, one comparison after the other."""
    if variable == "concurrency":
        raise ValueError("the concurrency sweep runs through concurrency_sweep (vLLM backend)")
    values = values or SWEEPS[variable]
    suite = SuiteRun(suite_id or uuid.uuid4().hex[:10])
    plan = [(item, value) for value in values for item in items]
    bar = tqdm(total=len(plan), desc=f"suite {suite.suite_id}", unit="run")
    served = None
    for i, (item, value) in enumerate(plan):
        if cancel is not None and cancel.is_set():
            suite.cancelled = True
            break
        if variable == "method" and getattr(backend, "name", "") == "vllm" and value != served:
            # vLLM's method is the speculative server's: restart it with this value's --speculative-config
            backend.reconfigure(speculative_config(value, base.k, backend.speculative_config.get("model")))
            served = value
        req = request_for(base, item, variable, value, suite_temperature and variable != "temperature")
        run_meta = meta | {"category": item.category, "suite_id": suite.suite_id,
                           "sweep_variable": None if variable == "none" else variable, "sweep_value": value or None}
        comp = Comparison(backend, req, mode, history, run_meta)
        comp.start()
        while not comp.poll(0.1):
            if cancel is not None and cancel.is_set():
                comp.cancel.set()  # this run is saved as cancelled; the ones before it stay complete
        suite.run_ids.append(comp.run_id)
        bar.update(1)
        if on_progress:
            on_progress(i + 1, len(plan), f"{item.category}: {item.prompt[:60]}")
    bar.close()
    suite.cancelled = suite.cancelled or (cancel is not None and cancel.is_set())
    return suite


# --- aggregates --------------------------------------------------------------------------------------------------


def runs_frame(history: History, suite_id: str) -> pd.DataFrame:
    """One row per stored run of a suite, with the figures the aggregates are built from."""
    rows = []
    for run in history.runs(suite_id=suite_id, limit=1_000_000):
        b = json.loads(run["baseline_metrics"] or "{}")
        s = json.loads(run["speculative_metrics"] or "{}")
        c = json.loads(run["comparison"] or "{}")
        total_ms = 1000 * s["output_tokens"] / s["tokens_per_s"] if s.get("tokens_per_s") else None
        rows.append({
            "run_id": run["id"], "category": run["category"], "status": run["status"],
            "sweep_variable": run["sweep_variable"], "sweep_value": run["sweep_value"] or "",
            "speedup": c.get("speedup"), "decode_speedup": c.get("decode_speedup"),
            "acceptance": s.get("acceptance_rate"), "alpha": c.get("alpha"),
            "mean_accepted_length": s.get("mean_accepted_length"),
            "per_position": s.get("per_position_acceptance") or [],
            "ttft_ms_baseline": b.get("ttft_ms"), "ttft_ms_speculative": s.get("ttft_ms"),
            "tpot_ms_baseline": b.get("tpot_ms"), "tpot_ms_speculative": s.get("tpot_ms"),
            "prefill_share": (s.get("prefill_ms") or 0) / total_ms if total_ms else None,
            "machine_bound": c.get("machine_bound"), "efficiency": c.get("efficiency"),
            "identical": c.get("identical"),
        })
    return pd.DataFrame(rows)


def _present(values) -> list:
    return [v for v in values if v is not None and v == v]  # v == v drops NaN


def _med(values) -> float | None:
    values = _present(values)
    return median(values) if values else None


def aggregate(runs: pd.DataFrame) -> pd.DataFrame:
    """Per category (and sweep value): medians with spread, over the completed runs."""
    if runs.empty:
        return pd.DataFrame()
    done = runs[runs["status"] == "completed"]
    rows = []
    for (category, value), g in done.groupby(["category", "sweep_value"], sort=True):
        speedups = _present(g["speedup"])
        positions = [p for p in g["per_position"] if p]
        width = max((len(p) for p in positions), default=0)
        rows.append({
            "category": category, "sweep_value": value, "runs": len(g),
            "speedup": _med(speedups), "speedup_min": min(speedups, default=None),
            "speedup_max": max(speedups, default=None),
            "acceptance": _med(g["acceptance"]), "alpha": _med(g["alpha"]),
            "mean_accepted_length": _med(g["mean_accepted_length"]),
            "per_position": [_med([p[i] for p in positions if len(p) > i]) for i in range(width)],
            "ttft_ms_baseline": _med(g["ttft_ms_baseline"]), "ttft_ms_speculative": _med(g["ttft_ms_speculative"]),
            "tpot_ms_baseline": _med(g["tpot_ms_baseline"]), "tpot_ms_speculative": _med(g["tpot_ms_speculative"]),
            "prefill_share": _med(g["prefill_share"]), "machine_bound": _med(g["machine_bound"]),
            "efficiency": _med(g["efficiency"]),
            "identical": f"{sum(v is True for v in g['identical'])}/{sum(v is not None for v in g['identical'])}",
        })
    return pd.DataFrame(rows)


def advice_for(backend, agg: pd.DataFrame, variable: str | None, concurrency: pd.DataFrame | None = None) -> list[Advice]:
    """The advisor's verdicts, with the backend's memory figures where it has them (the local backend)."""
    if agg.empty:
        return []
    memory = backend.memory() if hasattr(backend, "memory") else None
    return advise(agg, variable, memory=memory, concurrency=concurrency)


# --- concurrency (vLLM) ------------------------------------------------------------------------------------------


async def _burst(url: str, model: str, prompts: list[str], max_tokens: int, headers: dict) -> tuple[int, float]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0), headers=headers) as client:
        async def one(prompt):
            body = {"model": model, "messages": chat_messages(prompt), "max_tokens": max_tokens, "temperature": 0}
            r = await client.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        return sum(tokens), time.perf_counter() - start


def concurrency_sweep(backend, items: list[SuitePrompt], levels: list[int], max_new_tokens: int,
                      on_progress: Callable | None = None) -> pd.DataFrame:
    """Aggregate tokens/s of both vLLM servers at each number of parallel requests: where speculation stops paying."""
    if getattr(backend, "name", "") != "vllm":
        raise ValueError("the concurrency sweep needs the vLLM backend (in-process engines serve one request)")
    rows = []
    for i, level in enumerate(levels):
        prompts = [items[j % len(items)].prompt for j in range(level)]
        row = {"concurrency": level}
        for engine in ("baseline", "speculative"):
            tokens, seconds = asyncio.run(_burst(backend.urls[engine], backend.model, prompts, max_new_tokens,
                                                 backend.headers))
            row[f"{engine}_tps"] = tokens / seconds
        row["speedup"] = row["speculative_tps"] / row["baseline_tps"]
        rows.append(row)
        if on_progress:
            on_progress(i + 1, len(levels), f"concurrency {level}")
    return pd.DataFrame(rows)
