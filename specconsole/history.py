"""Every run, saved in a SQLite file (sqlite-utils): settings, prompt, outputs, all token events, metrics, status.

Tables: runs (one row per comparison), tokens, steps and policy (the engine's events, per engine), so that a past
run can be rebuilt event for event. The file uses WAL journaling and short transactions: a process killed
mid-run leaves a readable database, and the run it was doing is marked "interrupted" at the next start.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import sqlite_utils

from engine.events import PolicyEvent, RunResult, StepRecord, TokenEvent, TokenKind


class HistoryError(RuntimeError):
    """The database cannot be opened or written; the message says which file and what to do."""


RUN_COLUMNS = {
    "id": str, "created_at": str, "finished_at": str, "status": str, "error": str, "category": str, "prompt": str,
    "backend": str, "target_model": str, "draft_model": str, "method": str, "mode": str, "settings": str,
    "suite_id": str, "sweep_variable": str, "sweep_value": str, "baseline_output": str, "speculative_output": str, "baseline_metrics": str,
    "speculative_metrics": str, "comparison": str, "baseline_error": str, "speculative_error": str,
    "speedup": float, "acceptance_rate": float, "mean_accepted_length": float, "baseline_tps": float,
    "speculative_tps": float, "identical": int, "first_divergence": int,
    # trust: was the machine busy with other work during the run; is the sampled output as likely as the target's
    "noisy": int, "sampling_check": str, "nll_baseline": float, "nll_speculative": float, "repeat": int,
}


EVENT_TABLES = {  # the engines' events, one row each, keyed by run and engine
    "tokens": {"run_id": str, "engine": str, "seq": int, "kind": str, "token_id": int, "text": str, "step": int,
               "position": int, "time_s": float, "idx": int, "p": float, "q": float},
    "steps": {"run_id": str, "engine": str, "step": int, "drafted": int, "accepted": int, "emitted": int,
              "draft_ms": float, "verify_ms": float, "time_s": float},
    "policy": {"run_id": str, "engine": str, "step": int, "action": str, "k": int, "reason": str, "time_s": float},
}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class History:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.lock = threading.Lock()  # one writer at a time across browser tabs
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, check_same_thread=False, timeout=30)
            conn.execute("PRAGMA journal_mode=WAL")
            ok = conn.execute("PRAGMA quick_check").fetchone()[0]
            if ok != "ok":
                raise sqlite3.DatabaseError(ok)
            self.db = sqlite_utils.Database(conn)
            self._create()
            self.db.execute("UPDATE runs SET status = 'interrupted' WHERE status = 'running'")
            conn.commit()
        except (sqlite3.DatabaseError, OSError) as e:
            raise HistoryError(
                f"the history database {self.path} cannot be used ({e}). Move the file away to start a new history, "
                "or pass another path with --db."
            ) from e

    def _create(self) -> None:
        runs = self.db["runs"]
        runs.create(RUN_COLUMNS, pk="id", if_not_exists=True)
        for name, kind in RUN_COLUMNS.items():  # a database from an older version gains the new columns
            if name not in runs.columns_dict:
                runs.add_column(name, kind)
        for column in ("category", "created_at", "suite_id"):
            runs.create_index([column], if_not_exists=True)
        for table, columns in EVENT_TABLES.items():
            self.db[table].create(columns, foreign_keys=[("run_id", "runs", "id")], if_not_exists=True)
            self.db[table].create_index(["run_id"], if_not_exists=True)

    # --- writing ---------------------------------------------------------------------------------------------------

    def start_run(self, **fields) -> str:
        run_id = uuid.uuid4().hex[:12]
        row = {"id": run_id, "created_at": now(), "status": "running", **fields}
        if isinstance(row.get("settings"), dict):
            row["settings"] = json.dumps(row["settings"])
        self._write(lambda: self.db["runs"].insert(row))
        return run_id

    def finish_run(self, run_id: str, status: str, results: dict[str, RunResult], comparison: dict,
                   error: str | None = None) -> None:
        """Store both engines' results and events in one transaction."""
        b, s = results.get("baseline"), results.get("speculative")
        update = {
            "finished_at": now(), "status": status, "error": error,
            "baseline_output": b.output_text if b else None, "speculative_output": s.output_text if s else None,
            "baseline_metrics": json.dumps(b.metrics) if b else None,
            "speculative_metrics": json.dumps(s.metrics) if s else None,
            "baseline_error": b.error if b else None, "speculative_error": s.error if s else None,
            "comparison": json.dumps(comparison), "speedup": comparison.get("speedup"),
            "acceptance_rate": s.metrics.get("acceptance_rate") if s else None,
            "mean_accepted_length": s.metrics.get("mean_accepted_length") if s else None,
            "baseline_tps": b.metrics.get("tokens_per_s") if b else None,
            "speculative_tps": s.metrics.get("tokens_per_s") if s else None,
            "identical": None if "identical" not in comparison else int(comparison["identical"]),
            "first_divergence": comparison.get("first_divergence"),
            "noisy": None if comparison.get("noisy") is None else int(comparison["noisy"]),
            "sampling_check": comparison.get("sampling_check"),
            "nll_baseline": comparison.get("nll_baseline"), "nll_speculative": comparison.get("nll_speculative"),
        }

        def write():
            with self.db.conn:
                self.db["runs"].update(run_id, update)
                for engine, r in results.items():
                    self.db["tokens"].insert_all(
                        {"run_id": run_id, "engine": engine, "seq": i, **_token_row(t)} for i, t in enumerate(r.tokens)
                    )
                    self.db["steps"].insert_all({"run_id": run_id, "engine": engine, **asdict(st)} for st in r.steps)
                    self.db["policy"].insert_all({"run_id": run_id, "engine": engine, **asdict(p)} for p in r.policy)

        self._write(write)

    def delete(self, run_ids: list[str]) -> None:
        def write():
            with self.db.conn:
                for table in EVENT_TABLES:
                    self.db[table].delete_where("run_id IN (SELECT value FROM json_each(?))", [json.dumps(run_ids)])
                self.db["runs"].delete_where("id IN (SELECT value FROM json_each(?))", [json.dumps(run_ids)])

        self._write(write)

    def _write(self, fn) -> None:
        with self.lock:
            try:
                fn()
            except sqlite3.OperationalError as e:
                raise HistoryError(f"could not write to {self.path}: {e}") from e

    # --- reading ---------------------------------------------------------------------------------------------------

    def runs(self, category: str | None = None, limit: int = 500, suite_id: str | None = None) -> list[dict]:
        clauses = [(c, v) for c, v in (("category = ?", category), ("suite_id = ?", suite_id)) if v]
        where = " AND ".join(c for c, _ in clauses) or None
        args = [v for _, v in clauses] or None
        return list(self.db["runs"].rows_where(where, args, order_by="created_at desc, rowid desc", limit=limit))

    def suites(self) -> list[dict]:
        return list(self.db.query(
            "SELECT suite_id, min(created_at) AS started, count(*) AS runs, group_concat(DISTINCT category) AS "
            "categories, max(sweep_variable) AS sweep FROM runs WHERE suite_id IS NOT NULL GROUP BY suite_id "
            "ORDER BY started DESC"
        ))

    def run(self, run_id: str) -> dict | None:
        rows = list(self.db["runs"].rows_where("id = ?", [run_id]))
        return rows[0] if rows else None

    def results(self, run_id: str) -> dict[str, RunResult]:
        """Rebuild both engines' RunResults from the stored events."""
        row = self.run(run_id)
        if row is None:
            return {}
        out = {}
        for engine in ("baseline", "speculative"):
            if row.get(f"{engine}_metrics") is None and row.get(f"{engine}_output") is None:
                continue
            r = RunResult(engine=engine, method=row["method"] if engine == "speculative" else "none", prompt_tokens=0)
            r.tokens = [_token(t) for t in self.db["tokens"].rows_where("run_id = ? AND engine = ?", [run_id, engine],
                                                                       order_by="seq")]
            r.steps = [StepRecord(**{k: st[k] for k in StepRecord.__dataclass_fields__})
                       for st in self.db["steps"].rows_where("run_id = ? AND engine = ?", [run_id, engine], order_by="rowid")]
            r.policy = [PolicyEvent(**{k: p[k] for k in PolicyEvent.__dataclass_fields__})
                        for p in self.db["policy"].rows_where("run_id = ? AND engine = ?", [run_id, engine], order_by="rowid")]
            r.output_text = row.get(f"{engine}_output") or ""
            r.output_ids = [t.token_id for t in r.output_tokens]
            r.metrics = json.loads(row.get(f"{engine}_metrics") or "{}")
            r.error = row.get(f"{engine}_error")
            out[engine] = r
        return out

    def tokens(self, run_ids: list[str]) -> list[dict]:
        return list(self.db.query(
            "SELECT * FROM tokens WHERE run_id IN (SELECT value FROM json_each(?)) ORDER BY run_id, engine, seq",
            [json.dumps(run_ids)],
        ))


def _token_row(t: TokenEvent) -> dict:
    row = t.to_dict()
    row["idx"] = row.pop("index")  # the output position; "index" reads badly in SQL
    return row


def _token(row: dict) -> TokenEvent:
    return TokenEvent(TokenKind(row["kind"]), row["token_id"], row["text"], row["step"], row["position"],
                      row["time_s"], row["idx"], row["p"], row["q"])
