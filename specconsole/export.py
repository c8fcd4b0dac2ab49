"""CSV export of the history (pandas): one summary row per run, and one row per token event.

A spreadsheet runs a cell that starts with = + - @ (or a tab / carriage return) as a formula; model output and
prompts are untrusted text, so such string cells get a leading apostrophe.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from specconsole.history import History

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")

SUMMARY_COLUMNS = [
    "id", "created_at", "finished_at", "status", "error", "category", "backend", "target_model", "draft_model",
    "method", "mode", "suite_id", "prompt", "baseline_output", "speculative_output", "speedup", "acceptance_rate",
    "mean_accepted_length", "baseline_tps", "speculative_tps", "identical", "first_divergence", "noisy", "sampling_check", "nll_baseline", "nll_speculative",
    "repeat",
]


def neutralise(value):
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


def _frame(rows: list[dict], columns: list[str] | None = None) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=columns)
    return df.map(neutralise)


def summary_frame(history: History, run_ids: list[str] | None = None) -> pd.DataFrame:
    runs = [history.run(i) for i in run_ids] if run_ids else history.runs(limit=1_000_000)
    rows = []
    for run in filter(None, runs):
        row = {c: run.get(c) for c in SUMMARY_COLUMNS}
        for key, value in json.loads(run.get("settings") or "{}").items():
            row[f"setting_{key}"] = value
        comparison = json.loads(run.get("comparison") or "{}")
        for key in ("decode_speedup", "alpha", "theoretical_bound", "machine_bound", "efficiency"):
            row[key] = comparison.get(key)
        for engine in ("baseline", "speculative"):
            metrics = json.loads(run.get(f"{engine}_metrics") or "{}")
            for key in ("output_tokens", "ttft_ms", "tpot_ms", "target_passes", "drafted", "accepted"):
                if key in metrics:
                    row[f"{engine}_{key}"] = metrics[key]
        rows.append(row)
    return _frame(rows, None if rows else SUMMARY_COLUMNS)


def tokens_frame(history: History, run_ids: list[str] | None = None) -> pd.DataFrame:
    ids = run_ids or [r["id"] for r in history.runs(limit=1_000_000)]
    columns = ["run_id", "engine", "seq", "kind", "token_id", "text", "step", "position", "time_s", "idx", "p", "q"]
    return _frame(history.tokens(ids), columns)


def export_csv(history: History, out_dir: Path, run_ids: list[str] | None = None) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, tokens = out_dir / "specconsole_runs.csv", out_dir / "specconsole_tokens.csv"
    summary_frame(history, run_ids).to_csv(summary, index=False)
    tokens_frame(history, run_ids).to_csv(tokens, index=False)
    return summary, tokens
