"""The history file (specconsole.history): a run its process left unfinished is interrupted, a damaged or unwritable
file is a clear error, runs are deleted; and the CSV export's cells cannot run as formulas (specconsole.export)."""

import sqlite3
from pathlib import Path

import pytest

from specconsole.export import neutralise
from specconsole.history import History, HistoryError


def test_csv_cells_are_neutralised():
    for cell in ["=1+1", "+SUM(A1)", "-2+3", "@cmd", "\tx"]:
        assert neutralise(cell) == "'" + cell
    assert neutralise("plain") == "plain" and neutralise(-3) == -3


def test_interrupted_run_is_marked_at_next_start(tmp_path):
    """A run whose process ended without finishing it (here: a real process that exits) is interrupted."""
    import subprocess
    import sys

    code = f"from specconsole.history import History; print(History({str(tmp_path / 'h.db')!r}).start_run(prompt='x'))"
    run_id = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert History(tmp_path / "h.db").run(run_id)["status"] == "interrupted"


def test_corrupt_database_gives_a_clear_message(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(HistoryError, match="cannot be used"):
        History(bad)


def test_unwritable_database_location(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(HistoryError):
        History(blocker / "sub" / "h.db")


def test_delete(tmp_path):
    history = History(tmp_path / "h.db")
    keep, gone = history.start_run(prompt="a"), history.start_run(prompt="b")
    history.delete([gone])
    assert [r["id"] for r in history.runs()] == [keep]
    assert sqlite3.connect(tmp_path / "h.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_every_csv_figure_is_a_run_metric_and_documented():
    """The CSVs' per-engine figures are named once (specconsole.columns), each a RunMetrics field, each explained in
    docs/history.md's table of CSV columns."""
    from dataclasses import fields

    from engine.run_metrics import RunMetrics
    from specconsole.columns import ENGINE_FIGURES

    assert set(ENGINE_FIGURES) <= {f.name for f in fields(RunMetrics)}
    doc = (Path(__file__).resolve().parent.parent / "docs" / "history.md").read_text()
    table = doc.split("## The CSV files")[1].split("\n## ")[0]
    assert [k for k in ENGINE_FIGURES if f"`{k}`" not in table] == []


def test_the_servers_counters_disagreement_is_exported(tmp_path):
    """A server run's counters are kept with its metrics; where they disagree with the run's count, both CSVs say
    what differs (server_counters_mismatch); a formula-like sentence stays text."""
    import pandas as pd

    from engine.comparison import ComparisonFigures
    from engine.events import RunResult
    from engine.run_metrics import RunMetrics, ServerCounters
    from specconsole.export import export_all

    history = History(tmp_path / "h.db")
    run_id = history.start_run(prompt="x", method="llamacpp-draft")
    base, spec = RunResult("baseline", "none", 0), RunResult("speculative", "llamacpp-draft", 0)
    spec.metrics = RunMetrics(drafted=36, accepted=30, server={"drafted": 36, "accepted": 30},
                              server_counters=ServerCounters(10, 40, 31, mismatch="=the server counted 40"))
    history.finish_run(run_id, "completed", {"baseline": base, "speculative": spec}, ComparisonFigures())
    assert history.results(run_id)["speculative"].metrics.server_counters == spec.metrics.server_counters
    runs_csv, _, engines_csv = export_all(history, tmp_path / "csv")
    engines = pd.read_csv(engines_csv)
    assert engines["server_counters_mismatch"].fillna("").tolist() == ["", "'=the server counted 40"]
    assert pd.read_csv(runs_csv).loc[0, "speculative_server_counters_mismatch"] == "'=the server counted 40"


def test_a_history_file_of_a_newer_schema_is_refused_untouched(tmp_path):
    from specconsole.history_schema import SCHEMA_VERSION

    path = tmp_path / "h.db"
    History(path).db.conn.close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(HistoryError, match="newer SpecConsole"):
        History(path)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
    conn.close()
