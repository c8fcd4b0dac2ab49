"""The history file's tables, its schema version and the migration of older files (specconsole.history reads and
writes them).

Version 1 had no version set: the runs table held the baseline's and the main speculative engine's output, metrics
and error (and at first there was no engines table). Version 2 keeps every engine's in the engines table only.
"""

from __future__ import annotations

import logging
import sqlite3

import sqlite_utils

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2

RUN_COLUMNS = {
    "id": str, "created_at": str, "finished_at": str, "status": str, "error": str, "category": str, "prompt": str,
    "backend": str, "target_model": str, "draft_model": str, "method": str, "mode": str, "settings": str,
    "suite_id": str, "sweep_variable": str, "sweep_value": str, "comparison": str,
    # the headline figures, for the History table (the main speculative engine against the baseline)
    "speedup": float, "acceptance_rate": float, "mean_accepted_length": float, "baseline_tps": float,
    "speculative_tps": float, "identical": int, "first_divergence": int,
    # trust: was the machine busy with other work during the run; is the sampled output as likely as the target's
    "noisy": int, "sampling_check": str, "nll_baseline": float, "nll_speculative": float, "repeat": int,
    # the process that runs it: a run is "interrupted" only once this process is gone
    "owner_host": str, "owner_pid": int, "owner_started": str,
}

EVENT_TABLES = {  # the engines' events, one row each, keyed by run and engine
    "tokens": {"run_id": str, "engine": str, "seq": int, "kind": str, "token_id": int, "text": str, "step": int,
               "position": int, "time_s": float, "idx": int, "p": float, "q": float,
               "provisional": int,  # 1: the kind is a guess from a vLLM stream's chunks, not (yet) confirmed
               # greedy: the target's second choice (id from our engine, text from vLLM) and the chosen token's margin
               "runner_up": int, "margin": float, "runner_up_text": str},
    "steps": {"run_id": str, "engine": str, "step": int, "drafted": int, "accepted": int, "emitted": int,
              "draft_ms": float, "verify_ms": float, "time_s": float, "drafter": str,
              "ignored": int},  # NULL: not known (a server), or saved before it was counted
    "policy": {"run_id": str, "engine": str, "step": int, "action": str, "k": int, "reason": str, "time_s": float},
}

# One row per engine of a run. JSON in settings, metrics (engine.run_metrics.RunMetrics) and comparison.
ENGINE_COLUMNS = {"run_id": str, "engine": str, "label": str, "method": str, "settings": str, "output": str,
                  "metrics": str, "comparison": str, "error": str}


def create(db: sqlite_utils.Database) -> None:
    """The tables and indexes, or an older file brought to this version; sqlite3.DatabaseError for a file of a
    newer version (nothing in it is changed)."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise sqlite3.DatabaseError(f"it was written by a newer SpecConsole (history schema {version}; this version "
                                    f"reads up to {SCHEMA_VERSION})")
    runs = db["runs"]
    older = runs.exists() and version < SCHEMA_VERSION
    runs.create(RUN_COLUMNS, pk="id", if_not_exists=True)
    for name, kind in RUN_COLUMNS.items():  # a database from an older version gains the new columns
        if name not in runs.columns_dict:
            runs.add_column(name, kind)
    for columns in (["created_at"], ["suite_id"], ["status"], ["category", "created_at"]):
        runs.create_index(columns, if_not_exists=True)
    db.execute("DROP INDEX IF EXISTS idx_runs_category")  # covered by (category, created_at)
    for table, columns in EVENT_TABLES.items():
        db[table].create(columns, foreign_keys=[("run_id", "runs", "id")], if_not_exists=True)
        for name, kind in columns.items():  # a database from an older version gains the new columns
            if name not in db[table].columns_dict:
                db[table].add_column(name, kind)
        # tokens are read per run and engine in order (rebuilding a run, the CSV export): one index does it all
        db[table].create_index(["run_id", "engine", "seq"] if table == "tokens" else ["run_id"], if_not_exists=True)
    db.execute("DROP INDEX IF EXISTS idx_tokens_run_id")
    db["engines"].create(ENGINE_COLUMNS, pk=("run_id", "engine"), foreign_keys=[("run_id", "runs", "id")],
                         if_not_exists=True)
    if older:
        migrate_to_2(db)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def migrate_to_2(db: sqlite_utils.Database) -> None:
    """The baseline's and the main speculative engine's output, metrics and error move from the runs table's
    columns into the engines table (a run saved before that table existed gains its two rows), in one transaction."""
    runs = db["runs"].columns_dict
    with db.atomic():
        for engine in ("baseline", "speculative"):
            output, metrics, error = (f"{engine}_{part}" for part in ("output", "metrics", "error"))
            if not {output, metrics, error} <= set(runs):
                continue
            method = "method" if engine == "speculative" else "'none'"
            db.execute(f"INSERT OR IGNORE INTO engines (run_id, engine, label, method, settings) SELECT id, ?, ?, "
                       f"{method}, '{{}}' FROM runs WHERE coalesce({output}, {metrics}, {error}) IS NOT NULL OR "
                       f"EXISTS (SELECT 1 FROM tokens WHERE run_id = runs.id AND engine = ?)", [engine, engine, engine])
            comparison = "r.comparison" if engine == "speculative" else "NULL"  # the main one's is the run's
            db.execute(f"UPDATE engines SET output = coalesce(engines.output, r.{output}), metrics = coalesce("
                       f"engines.metrics, r.{metrics}), error = coalesce(engines.error, r.{error}), comparison = "
                       f"coalesce(engines.comparison, {comparison}) FROM runs AS r WHERE r.id = engines.run_id AND "
                       f"engines.engine = ?", [engine])
            for column in (output, metrics, error):
                db.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    log.info("the history was migrated to schema version %d", SCHEMA_VERSION)
