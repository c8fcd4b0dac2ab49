"""CSV export of the history: one summary row per run, and one row per token event.

Both files are written as the rows come from SQLite, a row at a time, so that exporting a long history (millions of
token events) takes little memory: nothing builds the whole table first. The export reads through a read-only
connection of its own, in one read transaction: both files show the same moment of the history, and a run that is
being saved meanwhile neither waits for the export nor gets in its way.

A spreadsheet runs a cell that starts with = + - @ (or a tab / carriage return) as a formula; model output and
prompts are untrusted text, so such string cells get a leading apostrophe.
"""

from __future__ import annotations

import contextlib
import csv
import json
import sqlite3
from pathlib import Path

from specconsole.history import EVENT_TABLES, History

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")

SUMMARY_COLUMNS = [
    "id", "created_at", "finished_at", "status", "error", "category", "backend", "target_model", "draft_model",
    "method", "mode", "suite_id", "prompt", "baseline_output", "speculative_output", "speedup", "acceptance_rate",
    "mean_accepted_length", "baseline_tps", "speculative_tps", "identical", "first_divergence", "noisy", "sampling_check", "nll_baseline", "nll_speculative",
    "repeat",
]
COMPARISON_KEYS = ("decode_speedup", "alpha", "theoretical_bound", "machine_bound", "efficiency")
# provisional_accuracy: vLLM runs only (how often the kinds guessed while streaming were right)
METRIC_KEYS = ("output_tokens", "ttft_ms", "tpot_ms", "target_passes", "drafted", "accepted", "provisional_accuracy")
TOKEN_COLUMNS = list(EVENT_TABLES["tokens"])


def neutralise(value):
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


def _neutralised_sql(column: str) -> str:
    """neutralise() as SQL, so that millions of token rows need no Python per cell."""
    starts = ", ".join(["'='", "'+'", "'-'", "'@'", "char(9)", "char(13)"])
    return f"CASE WHEN substr({column}, 1, 1) IN ({starts}) THEN '''' || {column} ELSE {column} END"


def _selection(column: str, run_ids: list[str] | None) -> tuple[str, list]:
    return (f"WHERE {column} IN (SELECT value FROM json_each(?))", [json.dumps(run_ids)]) if run_ids else ("", [])


def _summary_row(run: dict) -> dict:
    row = {c: run.get(c) for c in SUMMARY_COLUMNS}
    for key, value in json.loads(run.get("settings") or "{}").items():
        row[f"setting_{key}"] = value
    comparison = json.loads(run.get("comparison") or "{}")
    for key in COMPARISON_KEYS:
        row[key] = comparison.get(key)
    for engine in ("baseline", "speculative"):
        metrics = json.loads(run.get(f"{engine}_metrics") or "{}")
        for key in METRIC_KEYS:
            if key in metrics:
                row[f"{engine}_{key}"] = metrics[key]
    return row


@contextlib.contextmanager
def _snapshot(history: History):
    """A read-only connection to the history file, inside one read transaction."""
    conn = sqlite3.connect(f"{history.path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        conn.execute("BEGIN")
        yield conn
    finally:
        conn.close()


def write_summary(conn: sqlite3.Connection, path: Path, run_ids: list[str] | None = None) -> Path:
    """One row per run, newest first; settings and per-engine metrics become columns. Two passes over the runs:
    the first finds the columns (runs differ in their settings), the second writes."""
    where, args = _selection("id", run_ids)
    sql = f"SELECT * FROM runs {where} ORDER BY created_at DESC, rowid DESC"

    def runs():
        cursor = conn.execute(sql, args)
        names = [d[0] for d in cursor.description]
        return (dict(zip(names, row)) for row in cursor)

    columns = dict.fromkeys(SUMMARY_COLUMNS)
    for run in runs():
        columns.update(dict.fromkeys(_summary_row(run)))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), lineterminator="\n")
        writer.writeheader()
        for run in runs():
            writer.writerow({k: neutralise(v) for k, v in _summary_row(run).items()})
    return path


def write_tokens(conn: sqlite3.Connection, path: Path, run_ids: list[str] | None = None) -> Path:
    """One row per token event, by run, engine and order (the order of the tokens index: no sort)."""
    where, args = _selection("run_id", run_ids)
    # only the text is model output; run ids, engines and kinds are the console's own words
    select = ", ".join(_neutralised_sql(c) if c == "text" else c for c in TOKEN_COLUMNS)
    cursor = conn.execute(f"SELECT {select} FROM tokens {where} ORDER BY run_id, engine, seq", args)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(TOKEN_COLUMNS)
        writer.writerows(cursor)  # the cursor yields one row at a time
    return path


def export_csv(history: History, out_dir: Path, run_ids: list[str] | None = None) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    with _snapshot(history) as conn:
        return (write_summary(conn, out_dir / "specconsole_runs.csv", run_ids),
                write_tokens(conn, out_dir / "specconsole_tokens.csv", run_ids))
