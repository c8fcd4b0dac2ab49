"""Console logic without a browser: events in, HTML / figures / rows / CSV out."""

import sqlite3
import threading
import time

import gradio as gr
import pandas as pd
import pytest

from engine.request import Request
from engine.events import TokenEvent, TokenKind
from specconsole import charts
from specconsole.export import export_csv, neutralise
from specconsole.history import History, HistoryError
from specconsole.render import figures_html, token_span, tokens_html
from specconsole.runner import Comparison, EngineClock
from tests.conftest import PassLog, run_to_end


def test_tokens_are_escaped():
    evil = TokenEvent(TokenKind.ACCEPTED, 1, '<script>alert("x")</script>', 1, 0, 0.1, 0, 0.5, 0.25)
    html = token_span(evil)
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert 'class="tok accepted"' in html and "p(target) = 0.500" in html and "q(draft) = 0.250" in html
    rejected = token_span(TokenEvent(TokenKind.REJECTED, 2, "a&b", 1, 1, 0.1))
    assert rejected.startswith("<del") and "a&amp;b" in rejected
    assert "&lt;b&gt;" in tokens_html([], error="<b>bad</b>")


def test_provisional_tokens_are_marked_and_escaped():
    """A vLLM token whose kind is a guess from chunk boundaries: its own class and a note in the tooltip, model text
    escaped; once confirmed (provisional cleared) neither is left."""
    guess = TokenEvent(TokenKind.BONUS, 7, '<img src=x onerror="y">', 2, 3, 0.2, 5, provisional=True)
    html = token_span(guess)
    assert "<img" not in html and "&lt;img src=x onerror=&quot;y&quot;&gt;" in html
    assert 'class="tok bonus provisional"' in html and "provisional: from chunk boundaries" in html
    guess.provisional = False
    assert 'class="tok bonus"' in token_span(guess) and "chunk boundaries" not in token_span(guess)


def test_provisional_accuracy_is_a_vllm_figure():
    from engine.events import RunResult
    b, s = RunResult("baseline", "none", 0), RunResult("speculative", "ngram", 0)
    b.metrics = {"vllm_time_to_first_token_ms": 5.0}
    s.metrics = {"vllm_time_to_first_token_ms": 4.0, "provisional_accuracy": 0.75, "output_tokens": 12}
    assert "provisional kinds right" in (html := figures_html(b, s, {}, "fair", None)) and "75%" in html
    s.metrics["provisional_accuracy"] = None
    assert "unknown" in figures_html(b, s, {}, "fair", None).split("provisional kinds right")[1][:80]
    local = RunResult("speculative", "draft", 0)
    assert "provisional" not in figures_html(None, local, {}, "fair", None)  # not a figure of the local backend


def test_rejected_drafts_can_be_hidden():
    toks = [TokenEvent(TokenKind.ACCEPTED, 1, "x", 1, 0, 0.1, 0), TokenEvent(TokenKind.REJECTED, 2, "y", 1, 1, 0.1)]
    assert "rejected" in tokens_html(toks, show_rejected=True)
    assert "rejected" not in tokens_html(toks, show_rejected=False)


def test_csv_cells_are_neutralised():
    for cell in ["=1+1", "+SUM(A1)", "-2+3", "@cmd", "\tx"]:
        assert neutralise(cell) == "'" + cell
    assert neutralise("plain") == "plain" and neutralise(-3) == -3


@pytest.mark.parametrize("mode", ["fair", "race"])
def test_comparison_saved_and_rebuilt(backend, tmp_path, mode):
    history = History(tmp_path / "h.db")
    req = Request(prompt="=cmd|' /C calc'!A0 <script>", max_new_tokens=24, method="draft", k=3)
    comp = run_to_end(Comparison(backend, req, mode, history, {"category": "code", "backend": "local", "method": "draft"}))
    assert comp.status == "completed"
    c = comp.comparison()
    assert c["identical"] is True

    row = history.run(comp.run_id)
    assert row["status"] == "completed" and row["mode"] == mode and row["identical"] == 1
    rebuilt = history.results(comp.run_id)
    live = comp.results
    for engine in ("baseline", "speculative"):
        assert [t.to_dict() for t in rebuilt[engine].tokens] == [t.to_dict() for t in live[engine].tokens]
        assert rebuilt[engine].steps == live[engine].steps
    # the same HTML and figures come out of a rebuilt run
    assert tokens_html(rebuilt["speculative"].tokens) == tokens_html(live["speculative"].tokens)
    fig = charts.tokens_over_time(rebuilt["baseline"], rebuilt["speculative"])
    assert [len(t.x) for t in fig.data] == [24, 24]
    assert "speedup" in figures_html(rebuilt["baseline"], rebuilt["speculative"], c, mode, None)

    summary, tokens = export_csv(history, tmp_path / "out")
    runs = pd.read_csv(summary)
    assert list(runs["id"]) == [comp.run_id] and runs.loc[0, "prompt"].startswith("'=cmd")
    toks = pd.read_csv(tokens, keep_default_na=False)
    assert set(toks["engine"]) == {"baseline", "speculative"}
    assert len(toks) == len(live["baseline"].tokens) + len(live["speculative"].tokens)


def test_fair_mode_clocks_exclude_the_other_engine(backend):
    """Each engine's clock stands still while the other engine computes: read before and after every event of the
    other, it has not moved. Each total is on the engine's own clock and holds its own passes."""
    req = Request(prompt="hello there", max_new_tokens=40, method="draft", k=2)
    comp = Comparison(backend, req, "fair", None, {})
    log = PassLog(backend, {id(req): "speculative"})
    comp.backend = log
    run_to_end(comp)
    assert log.watched["baseline"] >= 80 and log.watched["speculative"] >= 40  # a token and a step per pass
    assert log.moved == [], log.moved[:5]
    for engine, r in comp.results.items():
        own = sum(st.verify_ms + st.draft_ms for st in r.steps) / 1000
        assert own <= r.total_s <= log.clocks[engine](), engine


def test_engine_clock_pauses():
    clock = EngineClock()
    clock.resume()
    clock.pause()
    frozen = clock()
    assert clock() == frozen


def test_cancel_keeps_a_cancelled_run(backend, tmp_path):
    history = History(tmp_path / "h.db")
    req = Request(prompt="hello", max_new_tokens=4000 // 20, method="draft", k=2)
    comp = Comparison(backend, req, "fair", history, {"category": "chat"})
    comp.cancel.set()
    run_to_end(comp)
    assert comp.status == "cancelled"
    assert history.run(comp.run_id)["status"] == "cancelled"


def test_engine_error_fails_one_panel_and_saves(backend, tmp_path, monkeypatch):
    history = History(tmp_path / "h.db")
    original = backend.speculative

    def broken(req, cancel=None, clock=None):
        gen = original(req, cancel, clock)
        yield next(gen)
        raise RuntimeError("the draft fell over")

    monkeypatch.setattr(backend, "speculative", broken)
    comp = run_to_end(Comparison(backend, Request(prompt="hi", max_new_tokens=12, k=2), "fair", history, {}))
    assert comp.results["baseline"].finish_reason == "length"  # the other engine finished
    assert "the draft fell over" in comp.results["speculative"].error
    row = history.run(comp.run_id)
    assert row["status"] == "failed" and "the draft fell over" in row["error"]


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


def _tok(kind: TokenKind, text: str, index: int) -> TokenEvent:
    return TokenEvent(kind, index, text, 1, index, 0.1, index)


def test_live_panel_sends_only_new_tokens():
    """Each update carries the tokens the page has not got yet; a re-classification re-sends the panel once."""
    import json

    from specconsole.render import PanelFeed

    feed = PanelFeed("run1")
    toks = [_tok(TokenKind.PENDING, "<b>", 0), _tok(TokenKind.PENDING, "x", 1)]
    first = json.loads(feed.message(toks, "running…"))
    assert first["start"] == 0 and len(first["tokens"]) == 2 and not first["reset"]
    assert "&lt;b&gt;" in first["tokens"][0] and "<b>" not in first["tokens"][0]
    assert feed.message(toks, "running…") is None  # nothing new: no message at all
    toks.append(_tok(TokenKind.PENDING, "y", 2))
    second = json.loads(feed.message(toks, "running…"))
    assert second["start"] == 2 and len(second["tokens"]) == 1 and second["total"] == 3
    # the end of a vLLM request classifies the pending tokens: the panel is re-sent once, from the start
    done = [_tok(TokenKind.ACCEPTED, t.text, i) for i, t in enumerate(toks)]
    final = json.loads(feed.message(done, "length · 3 tokens", final=True))
    assert final["reset"] and final["start"] == 0 and len(final["tokens"]) == 3
    assert final["final_html"] == "".join(final["tokens"])


def test_live_panel_hides_rejected_drafts_when_asked():
    import json

    from specconsole.render import PanelFeed

    toks = [_tok(TokenKind.ACCEPTED, "a", 0), _tok(TokenKind.REJECTED, "b", 1), _tok(TokenKind.RECOVERED, "c", 2)]
    shown = json.loads(PanelFeed("r", show_rejected=False).message(toks))
    assert shown["total"] == 2 and not any("rejected" in t for t in shown["tokens"])
    assert json.loads(PanelFeed("r").message(toks))["total"] == 3


def test_busy_machine_marks_the_run_noisy():
    """Another process that takes a core during the run makes its timings suspect, and the figures say so."""
    import subprocess
    import sys
    import time

    from specconsole.machine import MachineLoad

    load = MachineLoad()
    hog = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
    hog.wait()
    time.sleep(0.05)
    result = load.result()
    assert result["noisy"] and result["other_cores"] > 0.5, result
    assert "other processes used" in result["noise"]
    html = figures_html(None, None, result, "fair", None)
    assert "machine during the run" in html and "noisy" in html


def test_noisy_flag_is_saved_and_exported(backend, tmp_path):
    history = History(tmp_path / "h.db")
    req = Request(prompt="hello", max_new_tokens=8, method="draft", k=2)
    comp = run_to_end(Comparison(backend, req, "fair", history, {"category": "chat"}))
    c = comp.comparison()
    assert {"noisy", "other_cores", "load_average"} <= c.keys()
    assert history.run(comp.run_id)["noisy"] == int(c["noisy"])
    summary, _ = export_csv(history, tmp_path / "csv")
    assert pd.read_csv(summary).loc[0, "noisy"] == int(c["noisy"])


def test_ui_lock_is_taken_in_turn_so_an_engine_cannot_starve_the_page():
    """The fair-mode engine thread takes ui_lock around every pass, back to back. The page (and the saves that keep
    a killed run's tokens) must get its turn after at most one more pass, however eager the engine is."""
    from specconsole.runner import TurnLock

    lock, passes, stop = TurnLock(), [], threading.Event()

    def engine():
        while not stop.is_set():
            with lock:
                passes.append(1)
                time.sleep(0.002)

    t = threading.Thread(target=engine)
    t.start()
    try:
        waits = []
        for _ in range(30):
            before = len(passes)
            with lock:
                assert lock.locked()
                waits.append(len(passes) - before)
    finally:
        stop.set()
        t.join()
    assert not lock.locked()
    assert max(waits) <= 1, f"passes the page waited for: {waits}"


def test_run_meta_is_what_actually_ran(backend):
    """The method saved with a run: the request's where the backend applies it, else the server's."""
    from specconsole.runner import run_meta
    from tests.test_workbench import ServerLike

    assert run_meta(backend, Request(prompt="x", method="ngram")) | {"target_model": ""} == {
        "backend": "local", "target_model": "", "draft_model": None, "method": "ngram"}
    assert run_meta(backend, Request(prompt="x", method="draft"))["draft_model"] == "tiny-draft"
    served = run_meta(ServerLike(backend), Request(prompt="x", method="draft"))
    assert served["method"] == "eagle" and served["draft_model"] == "/m/eagle"


def test_one_set_of_request_defaults():
    """The page's controls, `launch.py demo` and `launch.py suite` build requests alike, from the same defaults."""
    import argparse

    import launch
    from engine import request as r

    demo = argparse.ArgumentParser()
    launch.add_request_args(demo)
    assert launch.build_request(demo.parse_args([]), "p", "draft") == r.build_request("p")
    suite = argparse.ArgumentParser()
    launch.add_request_args(suite, suite=True)
    assert launch.build_request(suite.parse_args([]), "", "draft") == r.build_request(
        "", max_new_tokens=r.SUITE_MAX_NEW_TOKENS)
    req = r.build_request("p", max_new_tokens=12.0, seed="", k=20.0, method="ngram", draft_confidence=0.5,
                          draft_vocab=4096.0)
    assert (req.max_new_tokens, req.sampling.seed, req.k, req.k_max, req.draft_confidence, req.draft_vocab) == (
        12, None, 20, 20, 0.0, 0)
    assert r.build_request("p", method="hybrid", draft_vocab=4096.0).draft_vocab == 4096
    assert r.build_request("p", draft_vocab=None).draft_vocab == 0  # an emptied number box


def test_page_greys_out_what_the_backend_does_not_apply(backend):
    from specconsole.host import ModelHost
    from specconsole.tab_run import DRAFTING_CONTROLS, backend_view
    from tests.test_workbench import ServerLike

    host = ModelHost("x", lambda p: None)
    assert all(u == gr.skip() for u in backend_view(host))  # still loading: nothing changes yet
    host.backend = ServerLike(backend)
    *controls, section, compare = backend_view(host)
    assert len(controls) == len(DRAFTING_CONTROLS)
    assert all(u["interactive"] is False and "set by the vLLM server (eagle)" in u["info"] for u in controls)
    assert section["visible"] is False  # attached servers cannot be reconfigured from the page
    assert compare == gr.skip()  # not fixed variants: the presets stay
    host.backend = backend
    *controls, section, compare = backend_view(host)
    assert all(u["interactive"] is True for u in controls) and section["visible"] is False


def test_the_page_builds_with_its_elements(tmp_path):
    from specconsole.app import build
    from specconsole.host import ModelHost

    app = build(ModelHost("not loaded", lambda p: None), History(tmp_path / "h.db"))
    ids = {getattr(b, "elem_id", None) for b in app.blocks.values()}
    assert {"model-status", "prompt", "run", "stop", "temperature", "max-new", "baseline-panel", "speculative-panel",
            "figures", "chart-steps", "history-table", "export-all", "open-run", "run-suite", "suite-status",
            "export-suite", "suite-files", "one-at-a-time"} <= ids
