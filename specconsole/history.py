"""Every run, saved in a SQLite file (sqlite-utils): settings, prompt, outputs, all token events, metrics, status.

Tables: runs (one row per comparison: settings, prompt, status and the headline figures the History table lists),
engines (one row per engine of a run: its label, drafting settings, output, metrics and comparison with the
baseline; "baseline", "speculative", "speculative-2", ...), and tokens, steps and policy (the engines' events), so that
a past run can be rebuilt event for event. The schema has a version (SQLite's user_version; specconsole.history_schema);
a file of an older version is migrated when it is opened, one of a newer version is refused.

The file uses WAL journaling and short transactions. While a run goes on, its new events are appended about once a
second (`save_events`); the end of the run writes the rest and the summary.
A process killed mid-run therefore leaves a readable database with the tokens the run had streamed, and the run is
marked "interrupted" the next time the file is opened.

Each run records its owner (specconsole.run_owner), so that a second console or `launch.py suite` on the same file
marks only the runs of processes that are gone.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import sqlite3
import threading
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import sqlite_utils

from engine.comparison import ComparisonFigures
from engine.events import PolicyAction, PolicyEvent, RunResult, StepRecord, TokenEvent, TokenKind
from engine.metrics import run_metrics
from engine.run_metrics import RunMetrics
from specconsole.columns import LIST
from specconsole.history_schema import EVENT_TABLES, create
from specconsole.run_owner import owner, owner_gone

log = logging.getLogger(__name__)


class HistoryError(RuntimeError):
    """The database cannot be opened or written; the message says which file and what to do."""


LIST_COLUMNS = [c.key for c in LIST if c.key != "prompt"]  # the History table's (the prompt: its start only)

LONE_SURROGATE = re.compile("[\ud800-\udfff]")

INTERRUPTED = ("the process running it ended before the run did (killed, crashed or the machine stopped); the tokens "
               "it had streamed are kept")


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class EventLog:
    """Which of one run's events are in the database, so that each is written once: `save_events` appends what
    came since the last save, `finish_run` the rest. A saved token that an engine re-classifies later (vLLM tells
    the kinds when a request ends) is rewritten in place."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.counts: dict[tuple[str, str], int] = {}  # (engine, table) -> rows saved
        self.tokens: dict[str, list[dict]] = {}  # engine -> its token rows as saved

    def pending(self, results: dict[str, RunResult], changes: bool = False) -> tuple[dict, list[dict]]:
        """(table -> new rows, token rows that changed since they were saved; only looked for when `changes`)."""
        new: dict[str, list[dict]] = {table: [] for table in EVENT_TABLES}
        changed = []
        for engine, r in results.items():
            key = {"run_id": self.run_id, "engine": engine}
            n = self.counts.get((engine, "tokens"), 0)
            new["tokens"] += [key | {"seq": i, **_token_row(t)} for i, t in enumerate(r.tokens[n:], n)]
            if changes:  # the saved rows, compared with the same tokens now
                rows = [key | {"seq": i, **_token_row(t)} for i, t in enumerate(r.tokens[:n])]
                changed += [row for row, before in zip(rows, self.tokens.get(engine, [])) if row != before]
            n = self.counts.get((engine, "steps"), 0)
            new["steps"] += [key | asdict(s) for s in r.steps[n:]]
            n = self.counts.get((engine, "policy"), 0)
            new["policy"] += [key | asdict(p) | {"action": p.action.value} for p in r.policy[n:]]
        return new, changed

    def saved(self, new: dict[str, list[dict]], changed: list[dict]) -> None:
        """Count rows that were written."""
        for table, rows in new.items():
            for row in rows:
                key = (row["engine"], table)
                self.counts[key] = self.counts.get(key, 0) + 1
                if table == "tokens":
                    self.tokens.setdefault(row["engine"], []).append(row)
        for row in changed:
            self.tokens[row["engine"]][row["seq"]] = row


class History:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.lock = threading.Lock()  # one writer at a time across browser tabs
        self.unsaved: dict[str, str] = {}  # runs whose last write failed (full disk): run id -> why
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, check_same_thread=False, timeout=30)
            conn.execute("PRAGMA journal_mode=WAL")
            # WAL with synchronous=NORMAL: a commit is not fsync'ed (a checkpoint is), so the saves during a run
            # cost little; a killed process loses nothing, a power cut at most the last second or so
            conn.execute("PRAGMA synchronous=NORMAL")
            ok = conn.execute("PRAGMA quick_check").fetchone()[0]
            if ok != "ok":
                raise sqlite3.DatabaseError(ok)
            self.db = sqlite_utils.Database(conn)
            create(self.db)
            self._mark_interrupted()
        except (sqlite3.DatabaseError, OSError) as e:
            raise HistoryError(
                f"the history database {self.path} cannot be used ({e}). Move the file away to start a new history, "
                "or pass another path with --db."
            ) from e

    def _mark_interrupted(self) -> None:
        """Runs left 'running' by a process that is gone: 'interrupted', with the output they had streamed."""
        host, at = socket.gethostname(), datetime.now(timezone.utc)
        running = self.db.query("SELECT id, created_at, owner_host, owner_pid, owner_started FROM runs "
                                "WHERE status = 'running'")
        gone = [r["id"] for r in running if owner_gone(r, host, at)]
        if not gone:
            return
        try:
            with self.db.atomic():
                for run_id in gone:
                    self.db.execute("UPDATE runs SET status = 'interrupted', error = coalesce(error, ?) WHERE id = ?",
                                    [INTERRUPTED, run_id])
                    self.db.execute("INSERT OR IGNORE INTO engines (run_id, engine, label, settings) SELECT DISTINCT "
                                    "run_id, engine, engine, '{}' FROM tokens WHERE run_id = ?", [run_id])
                    for (engine,) in self.db.execute("SELECT engine FROM engines WHERE run_id = ?", [run_id]).fetchall():
                        self.db.execute("UPDATE engines SET output = coalesce(output, ?) WHERE run_id = ? AND engine = ?",
                                        [self._streamed_text(run_id, engine), run_id, engine])
        except sqlite3.OperationalError as e:  # a full disk: the history can still be read; marked at a later start
            log.warning("could not mark %d run(s) of ended processes as interrupted: %s", len(gone), e)
            return
        log.info("marked %d run(s) of ended processes as interrupted: %s", len(gone), ", ".join(gone))

    def _streamed_text(self, run_id: str, engine: str) -> str | None:
        rows = self.db.execute("SELECT text FROM tokens WHERE run_id = ? AND engine = ? AND kind != 'rejected' "
                               "ORDER BY seq", [run_id, engine]).fetchall()
        return "".join(text or "" for (text,) in rows) if rows else None

    # --- writing ---------------------------------------------------------------------------------------------------

    def start_run(self, engines: list[dict] | None = None, **fields) -> str:
        """A new 'running' run; `engines`: who takes part (engine, label, method, settings), for the engines table."""
        run_id = "r" + uuid.uuid4().hex[:11]  # a letter first: a CSV reader never takes "8451076e9647" for a number
        row = {"id": run_id, "created_at": now(), "status": "running", **owner(), **fields}
        if isinstance(row.get("settings"), dict):
            row["settings"] = json.dumps(row["settings"])
        engine_rows = [{"run_id": run_id, **e, "settings": json.dumps(e.get("settings") or {})} for e in engines or []]

        closing = dict(self.unsaved)

        def write():
            with self.db.atomic():
                self._close_unsaved(closing)
                self.db["runs"].insert(row)
                if engine_rows:
                    self.db["engines"].insert_all(engine_rows)

        self._write(write)
        for unsaved_id in closing:  # only once the transaction that marks them is in (a full disk rolls it back)
            self.unsaved.pop(unsaved_id, None)
        return run_id

    def save_events(self, saved: EventLog, results: dict[str, RunResult]) -> None:
        """Append the events that came since the last save, in one short transaction (called during a run)."""
        new, _ = saved.pending(results)
        if not any(new.values()):
            return

        def write():
            with self.db.atomic():
                for table, rows in new.items():
                    self._insert(table, rows)

        self._write(write, saved.run_id)
        saved.saved(new, [])

    def finish_run(self, run_id: str, status: str, results: dict[str, RunResult], comparison: ComparisonFigures,
                   error: str | None = None, saved: EventLog | None = None,
                   comparisons: dict[str, ComparisonFigures] | None = None,
                   checks: dict[str, dict] | None = None) -> None:
        """Store the summary and the events not saved yet (`saved`: what the run saved while it ran), in one
        transaction. `comparisons`: each speculative engine against the baseline (for the engines table; the
        main one's is `comparison`). `checks`: per speculative engine, the machine's load and the sampling check
        (specconsole.runner.Comparison.checks), saved beside its figures in the comparison column."""
        saved = saved or EventLog(run_id)
        checks = checks or {}
        comparisons = {"speculative": comparison} | (comparisons or {})
        stored = {e: c.to_dict() | checks.get(e, {}) for e, c in comparisons.items()}  # each engine's saved form
        check = checks.get("speculative", {})
        b, s = results.get("baseline"), results.get("speculative")
        update = {
            "finished_at": now(), "status": status, "error": error,
            "comparison": json.dumps(stored["speculative"]), "speedup": comparison.speedup,
            "acceptance_rate": s.metrics.acceptance_rate if s else None,
            "mean_accepted_length": s.metrics.mean_accepted_length if s else None,
            "baseline_tps": b.metrics.tokens_per_s if b else None,
            "speculative_tps": s.metrics.tokens_per_s if s else None,
            "identical": None if comparison.identical is None else int(comparison.identical),
            "first_divergence": comparison.first_divergence,
            "noisy": None if check.get("noisy") is None else int(check["noisy"]),
            "sampling_check": check.get("sampling_check"),
            "nll_baseline": check.get("nll_baseline"), "nll_speculative": check.get("nll_speculative"),
        }
        new, changed = saved.pending(results, changes=True)
        engine_rows = [[run_id, e, e, r.method, "{}"] for e, r in results.items()]
        engine_updates = [[r.output_text, json.dumps(r.metrics.to_dict()), json.dumps(stored[e])
                           if e in stored else None, r.error, run_id, e] for e, r in results.items()]

        def write():
            with self.db.atomic():
                self.db["runs"].update(run_id, update)
                # an engine that start_run did not name gets its row here, labelled by its name
                self.db.conn.executemany("INSERT OR IGNORE INTO engines (run_id, engine, label, method, settings) "
                                         "VALUES (?, ?, ?, ?, ?)", engine_rows)
                self.db.conn.executemany("UPDATE engines SET output = ?, metrics = ?, comparison = ?, error = ? "
                                         "WHERE run_id = ? AND engine = ?", engine_updates)
                for table, rows in new.items():
                    self._insert(table, rows)
                columns = [c for c in EVENT_TABLES["tokens"] if c not in ("run_id", "engine", "seq")]
                self.db.conn.executemany(
                    f"UPDATE tokens SET {', '.join(f'{c} = :{c}' for c in columns)} "
                    "WHERE run_id = :run_id AND engine = :engine AND seq = :seq", changed)

        self._write(write, run_id)
        saved.saved(new, changed)
        self.unsaved.pop(run_id, None)

    def delete(self, run_ids: list[str]) -> None:
        """Delete runs and their events, in one transaction."""
        ids = json.dumps(run_ids)

        def write():
            with self.db.atomic():
                for table in (*EVENT_TABLES, "engines"):
                    self.db.execute(f"DELETE FROM {table} WHERE run_id IN (SELECT value FROM json_each(?))", [ids])
                self.db.execute("DELETE FROM runs WHERE id IN (SELECT value FROM json_each(?))", [ids])

        self._write(write)

    def _insert(self, table: str, rows: list[dict]) -> None:
        columns = list(EVENT_TABLES[table])
        self.db.conn.executemany(
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
            [[row.get(c) for c in columns] for row in rows])

    def _close_unsaved(self, runs: dict[str, str]) -> None:
        """Runs whose saving failed earlier (the disk was full) stay 'running' in the file: once the file takes
        writes again, say what happened to them."""
        for run_id, why in runs.items():
            self.db.execute("UPDATE runs SET status = 'interrupted', error = ? WHERE id = ? AND status = 'running'",
                            [f"the run was not saved completely: {why}", run_id])

    def _write(self, fn, run_id: str | None = None) -> None:
        with self.lock:
            try:
                fn()
            except sqlite3.DatabaseError as e:  # full disk, read-only file, lost directory, ...
                if self.db.conn.in_transaction:
                    self.db.conn.rollback()
                if run_id is not None:
                    self.unsaved[run_id] = str(e)
                raise HistoryError(f"could not write to {self.path}: {e}") from e

    # --- reading ---------------------------------------------------------------------------------------------------

    def runs(self, category: str | None = None, limit: int = 500, suite_id: str | None = None) -> list[dict]:
        clauses = [(c, v) for c, v in (("category = ?", category), ("suite_id = ?", suite_id)) if v]
        where = " AND ".join(c for c, _ in clauses) or None
        args = [v for _, v in clauses] or None
        return list(self.db["runs"].rows_where(where, args, order_by="created_at desc, rowid desc", limit=limit))

    def page(self, category: str | None = None, page: int = 1, size: int = 100) -> tuple[list[dict], int, int]:
        """One page of runs for the History tab, newest first (only LIST_COLUMNS and the prompt's start): (rows, how
        many runs match, the page number kept in range). Both queries are answered from the indexes on created_at
        and (category, created_at)."""
        where, args = ("WHERE category = ?", [category]) if category else ("", [])
        total = self.db.execute(f"SELECT count(*) FROM runs {where}", args).fetchone()[0]
        page = min(max(page, 1), max(1, -(-total // size)))
        rows = list(self.db.query(
            f"SELECT {', '.join(LIST_COLUMNS)}, substr(prompt, 1, 80) AS prompt FROM runs {where} "
            "ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?", [*args, size, (page - 1) * size]))
        return rows, total, page

    def suites(self) -> list[dict]:
        return list(self.db.query(
            "SELECT suite_id, min(created_at) AS started, count(*) AS runs, group_concat(DISTINCT category) AS "
            "categories, max(sweep_variable) AS sweep FROM runs WHERE suite_id IS NOT NULL GROUP BY suite_id "
            "ORDER BY started DESC"
        ))

    def suite_metrics(self, suite_id: str) -> dict[str, dict[str, RunMetrics]]:
        """The baseline's and the main speculative engine's metrics of each run of a suite: run id -> engine ->
        RunMetrics (an engine that saved none is left out)."""
        rows = self.db.execute(
            "SELECT e.run_id, e.engine, e.metrics FROM engines AS e JOIN runs AS r ON r.id = e.run_id WHERE "
            "r.suite_id = ? AND e.engine IN ('baseline', 'speculative') AND e.metrics IS NOT NULL", [suite_id])
        out: dict[str, dict[str, RunMetrics]] = {}
        for run_id, engine, metrics in rows.fetchall():
            out.setdefault(run_id, {})[engine] = RunMetrics.from_dict(json.loads(metrics))
        return out

    def run(self, run_id: str) -> dict | None:
        rows = list(self.db["runs"].rows_where("id = ?", [run_id]))
        return rows[0] if rows else None

    def engines(self, run_id: str) -> dict[str, dict]:
        """The engines table's rows of a run, in the run's order (engine -> row, JSON parsed)."""
        rows = self.db["engines"].rows_where("run_id = ?", [run_id], order_by="rowid")
        return {r["engine"]: r | {k: json.loads(r[k]) if r[k] else None for k in ("settings", "metrics", "comparison")}
                for r in rows}

    def results(self, run_id: str) -> dict[str, RunResult]:
        """Rebuild every engine's RunResult (baseline, speculative, speculative-2, ...) from the stored events (of an
        interrupted run: what it had streamed, with its metrics computed from that)."""
        row = self.run(run_id)
        if row is None:
            return {}
        engines = self.engines(run_id)
        out = {}
        for engine in dict.fromkeys(["baseline", "speculative", *engines]):
            tokens = [_token(t) for t in self.db["tokens"].rows_where("run_id = ? AND engine = ?", [run_id, engine],
                                                                      order_by="seq")]
            saved = engines.get(engine, {})
            if saved.get("metrics") is None and saved.get("output") is None and not tokens:
                continue
            r = RunResult(engine=engine, method=saved.get("method") or "", prompt_tokens=0)
            r.tokens = tokens
            r.steps = [_step(st) for st in
                       self.db["steps"].rows_where("run_id = ? AND engine = ?", [run_id, engine], order_by="rowid")]
            r.policy = [_policy(p) for p in
                        self.db["policy"].rows_where("run_id = ? AND engine = ?", [run_id, engine], order_by="rowid")]
            r.output_text = saved.get("output") or ""
            r.output_ids = [t.token_id for t in r.output_tokens]
            r.metrics = RunMetrics.from_dict(saved.get("metrics"))
            r.error = saved.get("error")
            if not saved.get("metrics") and (r.tokens or r.steps):  # never finished: measure what there is
                r.total_s = max([t.time_s for t in r.tokens] + [s.time_s for s in r.steps])
                r.metrics = run_metrics(r)
            out[engine] = r
        return out


def _token_row(t: TokenEvent) -> dict:
    row = t.to_dict()
    row["idx"] = row.pop("index")  # the output position; "index" reads badly in SQL
    for key in ("text", "runner_up_text"):
        try:
            (row[key] or "").encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (half an emoji from a server's stream) is not UTF-8: U+FFFD
            row[key] = LONE_SURROGATE.sub("\ufffd", row[key])
    return row


def _step(row: dict) -> StepRecord:
    fields = {k: row[k] for k in StepRecord.__dataclass_fields__}
    return StepRecord(**fields | {"drafter": fields["drafter"] or ""})  # NULL in rows saved before it existed


def _policy(row: dict) -> PolicyEvent:
    return PolicyEvent(row["step"], PolicyAction(row["action"]), row["k"], row["reason"], row["time_s"])


def _token(row: dict) -> TokenEvent:
    return TokenEvent(TokenKind(row["kind"]), row["token_id"], row["text"], row["step"], row["position"],
                      row["time_s"], row["idx"], row["p"], row["q"], bool(row.get("provisional")),  # NULL: older
                      row.get("runner_up"), row.get("margin"), row.get("runner_up_text"))
