"""CSV export of the history: one summary row per run, one row per token event, and one row per engine of a run.

An N-way comparison's extra speculative engines ("speculative-2", ...) appear in the runs CSV as an `engines` column
(the engines of the run, in order) and columns prefixed by the engine's name; the tokens CSV has an `engine` column;
the engines CSV (export_all) has one row per run and engine, also for runs saved before the engines table existed.

Both files are written as the rows come from SQLite, a row at a time, so that exporting a long history (millions of
token events) takes little memory: nothing builds the whole table first. The export reads through a read-only
connection of its own, in one read transaction: both files show the same moment of the history, and a run that is
being saved meanwhile neither waits for the export nor gets in its way.

A spreadsheet runs a cell that starts with = + - @ (or a tab / carriage return) as a formula; model output and
prompts are untrusted text, so such string cells get a leading apostrophe.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import json
import logging
import os
import re
import shutil
import sqlite3
import tempfile
import threading
from pathlib import Path

from specconsole.history import EVENT_TABLES, History

log = logging.getLogger(__name__)

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")

SUMMARY_COLUMNS = [
    "id", "created_at", "finished_at", "status", "error", "category", "backend", "target_model", "draft_model",
    "method", "mode", "suite_id", "prompt", "baseline_output", "speculative_output", "speedup", "acceptance_rate",
    "mean_accepted_length", "baseline_tps", "speculative_tps", "identical", "first_divergence", "noisy", "sampling_check", "nll_baseline", "nll_speculative",
    "repeat",
]
COMPARISON_KEYS = ("decode_speedup", "alpha", "theoretical_bound", "machine_bound", "efficiency")
# Per engine, in both CSVs (the runs CSV prefixes them with the engine's name): docs/history.md#the-csv-files says
# what each means. provisional_accuracy: vLLM runs only (how often the kinds guessed while streaming were right)
METRIC_KEYS = ("output_tokens", "ttft_ms", "tpot_ms", "target_passes", "drafted", "accepted", "provisional_accuracy",
               "ignored_drafts", "acceptance_histogram", "steps_accepting_nothing", "drafting_ms", "verifying_ms",
               "other_ms")
TOKEN_COLUMNS = list(EVENT_TABLES["tokens"])
# the engines CSV: one row per run and engine
ENGINE_CSV_COLUMNS = ["run_id", "engine", "label", "method", "tokens_per_s", "speedup", "acceptance_rate",
                      "mean_accepted_length", "identical", "first_divergence", *METRIC_KEYS,
                      "error", "output"]


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


def _engine_rows(conn: sqlite3.Connection, run: dict) -> list[dict]:
    """One row per engine of the run, as the engines CSV has them. The baseline and the main speculative engine
    come from the runs table's columns (every version wrote them); the others from the engines table."""
    cursor = conn.execute("SELECT * FROM engines WHERE run_id = ? ORDER BY rowid", [run["id"]])
    names = [d[0] for d in cursor.description]
    saved = {r["engine"]: r for r in (dict(zip(names, row)) for row in cursor)}
    comparison = json.loads(run.get("comparison") or "{}")
    rows = []
    for engine in dict.fromkeys(["baseline", "speculative", *saved]):
        e = saved.get(engine, {})
        if engine in ("baseline", "speculative"):
            e = e | {"output": run.get(f"{engine}_output"), "metrics": run.get(f"{engine}_metrics"),
                     "error": run.get(f"{engine}_error"),
                     "comparison": json.dumps(comparison) if engine == "speculative" else None,
                     "label": e.get("label") or engine,
                     "method": run.get("method") if engine == "speculative" else "none"}
        metrics = json.loads(e.get("metrics") or "{}")
        c = json.loads(e.get("comparison") or "{}")
        identical = c.get("identical")
        rows.append({"run_id": run["id"], "engine": engine, "label": e.get("label"), "method": e.get("method"),
                     "tokens_per_s": metrics.get("tokens_per_s"), "speedup": c.get("speedup"),
                     "acceptance_rate": metrics.get("acceptance_rate"),
                     "mean_accepted_length": metrics.get("mean_accepted_length"),
                     "identical": None if identical is None else int(identical),
                     "first_divergence": c.get("first_divergence"),
                     **{k: metrics.get(k) for k in METRIC_KEYS}, "error": e.get("error"), "output": e.get("output")})
    return rows


def _summary_row(run: dict, engines: list[dict] | None = None) -> dict:
    """One run's row; `engines` (its _engine_rows) add the engines column and the extra engines' figures."""
    row = {c: run.get(c) for c in SUMMARY_COLUMNS}
    for key, value in json.loads(run.get("settings") or "{}").items():
        row[f"setting_{key}"] = value
    comparison = json.loads(run.get("comparison") or "{}")
    for key in COMPARISON_KEYS:
        row[key] = comparison.get(key)
    if comparison.get("identical") is False:  # the backend's reason a greedy output can part (llama.cpp)
        note = json.loads(run.get("speculative_metrics") or "{}").get("divergence_note")
        if note:
            row["divergence_note"] = note
    for engine in ("baseline", "speculative"):
        metrics = json.loads(run.get(f"{engine}_metrics") or "{}")
        for key in METRIC_KEYS:
            if key in metrics:
                row[f"{engine}_{key}"] = metrics[key]
    if engines is not None:
        row["engines"] = ",".join(e["engine"] for e in engines)
        for e in engines[2:]:  # speculative-2, ...: the first two have their columns above
            for key in ("label", "method", "tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_length",
                        "identical", "first_divergence", "output", "error", *METRIC_KEYS):
                row[f"{e['engine']}_{key}"] = e[key]
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
        columns.update(dict.fromkeys(_summary_row(run, _engine_rows(conn, run))))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), lineterminator="\n")
        writer.writeheader()
        for run in runs():
            writer.writerow({k: neutralise(v) for k, v in _summary_row(run, _engine_rows(conn, run)).items()})
    return path


def write_engines(conn: sqlite3.Connection, path: Path, run_ids: list[str] | None = None) -> Path:
    """One row per run and engine, newest run first, engines in the run's order."""
    where, args = _selection("id", run_ids)
    cursor = conn.execute(f"SELECT * FROM runs {where} ORDER BY created_at DESC, rowid DESC", args)
    names = [d[0] for d in cursor.description]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=ENGINE_CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        for values in cursor:
            for row in _engine_rows(conn, dict(zip(names, values))):
                writer.writerow({k: neutralise(v) for k, v in row.items()})
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
    """The runs CSV and the tokens CSV."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with _snapshot(history) as conn:
        return (write_summary(conn, out_dir / "specconsole_runs.csv", run_ids),
                write_tokens(conn, out_dir / "specconsole_tokens.csv", run_ids))


def export_all(history: History, out_dir: Path, run_ids: list[str] | None = None) -> tuple[Path, Path, Path]:
    """The runs, tokens and engines CSVs, all from the same moment of the history."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with _snapshot(history) as conn:
        return (write_summary(conn, out_dir / "specconsole_runs.csv", run_ids),
                write_tokens(conn, out_dir / "specconsole_tokens.csv", run_ids),
                write_engines(conn, out_dir / "specconsole_engines.csv", run_ids))


# --- where exported files go -------------------------------------------------------------------------------------

# An id that goes into a file name (suite_<id>.csv, replay-<id>.html): the console's own ids are hex (and conc-<n>);
# anything else, e.g. from an edited history file, could walk out of the export folder.
FILE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def file_id(value: str, what: str) -> str:
    """`value` if it can name a file as it is; ValueError otherwise (nothing is built from it)."""
    if not FILE_ID.fullmatch(value):
        raise ValueError(f"the {what} id {value[:80]!r} cannot name a file (only letters, digits, '-' and '_', at "
                         f"most 64): nothing was exported")
    return value


class ExportFolder:
    """This process's one folder for exported files: <temp>/specconsole-<pid>-<random>/, made private and
    unpredictable by mkdtemp on first use, removed when the process exits. Each kind of export (the runs CSVs, the
    replays, a suite) has a subfolder that the next export of that kind empties first, so that repeated exports take
    the space of the last one. The page runs one export of a kind at a time (the handlers' concurrency_limit=1):
    the next export would empty the folder while Gradio copies the files of the last."""

    def __init__(self, base: str | Path | None = None):
        self.base = Path(base) if base is not None else None  # None: tempfile.gettempdir()
        self._root: Path | None = None
        self._lock = threading.Lock()

    def root(self) -> Path:
        with self._lock:
            if self._root is None or not self._root.is_dir():
                if self.base is not None:
                    self.base.mkdir(parents=True, exist_ok=True)
                self._root = Path(tempfile.mkdtemp(prefix=f"specconsole-{os.getpid()}-", dir=self.base))
                atexit.register(shutil.rmtree, self._root, True)
                log.info("exported files go to %s (each export replaces the last of its kind; removed at exit)",
                         self._root)
            return self._root

    def fresh(self, kind: str) -> Path:
        """The empty subfolder for an export of `kind` (the files of the last such export are removed)."""
        folder = self.root() / file_id(kind, "export kind")
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        return folder


EXPORTS = ExportFolder()  # the console's
