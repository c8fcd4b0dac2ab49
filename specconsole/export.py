"""CSV export of the history: one summary row per run, one row per token event, and one row per engine of a run.

The runs CSV names the engines of a run, in order, in an `engines` column, and gives each engine's columns prefixed
by its name ("baseline_", "speculative_", "speculative-2_", ...); the tokens CSV has an `engine` column; the engines
CSV (export_all) has one row per run and engine. The columns are named in specconsole.columns.

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

from engine.comparison import ComparisonFigures
from engine.run_metrics import RunMetrics
from specconsole.columns import (COMPARISON_DETAIL, COMPARISON_FIGURES, ENGINE_CSV, RUN_CSV, comparison_figures,
                                 engine_figures)
from specconsole.history import History
from specconsole.history_schema import EVENT_TABLES

log = logging.getLogger(__name__)

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
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


def _engine_rows(conn: sqlite3.Connection, run: dict) -> list[dict]:
    """One row per engine of the run (ENGINE_CSV), in the run's order."""
    cursor = conn.execute("SELECT * FROM engines WHERE run_id = ? ORDER BY rowid", [run["id"]])
    names = [d[0] for d in cursor.description]
    rows = []
    for e in (dict(zip(names, row)) for row in cursor):
        c = ComparisonFigures.from_dict(json.loads(e["comparison"] or "{}"))
        m = RunMetrics.from_dict(json.loads(e["metrics"] or "{}"))
        identical = c.identical
        rows.append({"run_id": run["id"], "engine": e["engine"], "label": e["label"] or e["engine"],
                     "method": e["method"], **comparison_figures(c, COMPARISON_FIGURES),
                     "identical": None if identical is None else int(identical),
                     **engine_figures(m), "server_counters_mismatch": _counters_mismatch(m),
                     "error": e["error"], "output": e["output"],
                     "divergence_note": m.divergence_note if identical is False else None})
    return rows


def _counters_mismatch(m: RunMetrics) -> str | None:
    """Where the server's own counters disagree with the run's count: what differs."""
    mismatch = m.server_counters.mismatch if m.server_counters else None
    return mismatch if isinstance(mismatch, str) else None  # an edited file may hold anything


def _summary_row(run: dict, engines: list[dict]) -> dict:
    """One run's row: its own columns, settings and comparison figures, then each engine's columns (its
    _engine_rows) prefixed by the engine's name."""
    row = {c: run.get(c) for c in RUN_CSV}
    for key, value in json.loads(run.get("settings") or "{}").items():
        row[f"setting_{key}"] = value
    row |= comparison_figures(ComparisonFigures.from_dict(json.loads(run.get("comparison") or "{}")),
                              COMPARISON_DETAIL)
    notes = [e["divergence_note"] for e in engines if e["divergence_note"]]
    if notes:  # the backend's reason a greedy output can part (llama.cpp)
        row["divergence_note"] = notes[0]
    row["engines"] = ",".join(e["engine"] for e in engines)
    for e in engines:
        for key in ENGINE_CSV[2:]:
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

    columns = dict.fromkeys(RUN_CSV)
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
        writer = csv.DictWriter(f, fieldnames=ENGINE_CSV, lineterminator="\n", extrasaction="ignore")
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
