"""Faults and scale of the history, with real parts: real SQLite files, real processes, the real runner on tiny
models, SmolLM2's real tokenizer. (The browser half is tests/test_browser_faults.py.)"""

import csv
import io
import json
import logging
import os
import socket
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pandas as pd
import pytest

from engine.drafting import Drafting
from engine.request import Request
from engine.comparison import ComparisonFigures
from engine.exact.proposers import Proposal
from engine.events import PolicyAction, PolicyEvent, Reclassified, RunResult, StepRecord, TokenEvent, TokenKind
from engine.exact.decode import _Recorder, generate_speculative
from engine.metrics import run_metrics
from engine.exact.policy import PolicyConfig, SpecPolicy
from engine.sampling_params import SamplingParams
from engine.stops import StopConditions
from specconsole import runner
from specconsole.export import export_csv, neutralise
from specconsole.history import LIST_COLUMNS, History
from specconsole.run_owner import process_start
from specconsole.render import tokens_html
from specconsole.runner import Comparison
from tests.big_history import big_history_copy, make_big_history
from tests.conftest import db_rows, hello_there, run_to_end

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent

# one character, three byte-level tokens in SmolLM2's tokenizer (each alone decodes to U+FFFD)
PARROT = "🦜"
# right-to-left, zero-width (space, joiner), an astral letter, a character split over 3 tokens, markup
UNICODE_TEXT = ("Parrot 🦜 says שלום עולם and مرحبا; a\u200bb, 🧑\u200d🚀, 𝔘 ꙮ, 漢字, "
                "<script>alert('x')</script> =SUM(A1) \u202eevil end")  # an override that nothing closes


# --- incremental saving ------------------------------------------------------------------------------------------


def test_events_are_saved_while_the_run_goes_on(backend, tmp_path, monkeypatch):
    """Each poll may append the new events (here: every poll); in the end every event is in once, in order, and the
    saves ran under ui_lock (so in fair mode never during a timed pass)."""
    monkeypatch.setattr(runner, "SAVE_EVERY_S", 0.0)
    db = tmp_path / "h.db"
    history = History(db)
    comp = Comparison(backend, hello_there(120, k=3), "fair", history, {"category": "chat"})
    locked, partial = [], []
    save_events = history.save_events

    def watched(*args):
        locked.append(comp.ui_lock.locked())
        return save_events(*args)

    monkeypatch.setattr(history, "save_events", watched)

    def look():
        if not comp.saved:  # while it runs: what another process would find in the file
            partial.append(db_rows(db, "SELECT count(*) FROM tokens WHERE run_id = ?", [comp.run_id])[0][0])

    run_to_end(comp, look)
    live = comp.results
    total = sum(len(r.tokens) for r in live.values())
    assert any(0 < n < total for n in partial), f"nothing was saved while the run went on: {partial[-5:]}"
    assert locked and all(locked)
    rebuilt = history.results(comp.run_id)
    for engine in ("baseline", "speculative"):
        assert [t.to_dict() for t in rebuilt[engine].tokens] == [t.to_dict() for t in live[engine].tokens]
        assert rebuilt[engine].steps == live[engine].steps and rebuilt[engine].policy == live[engine].policy
    seqs = db_rows(db, "SELECT engine, seq, count(*) FROM tokens WHERE run_id = ? GROUP BY engine, seq "
                       "HAVING count(*) > 1", [comp.run_id])
    assert seqs == [], "events written twice"
    assert history.run(comp.run_id)["status"] == "completed"


class ReclassifyingBackend:
    """Streams the speculative engine's tokens as 'pending' and tells their kinds only at the end, in a Reclassified
    event before the result, as the vLLM backend does; the events it yielded stay as they were."""

    def __init__(self):
        self.streamed = {"baseline": [], "speculative": []}

    def baseline(self, req, cancel=None, clock=None):
        yield from self._stream("baseline", TokenKind.BASELINE)

    def speculative(self, req, cancel=None, clock=None):
        yield from self._stream("speculative", TokenKind.PENDING)

    def _stream(self, engine, kind):
        result = RunResult(engine=engine, method="vllm", prompt_tokens=3)
        for i in range(12):
            time.sleep(0.01)
            token = TokenEvent(kind, 100 + i, f"w{i} ", 0, 0, 0.01 * i, i)
            result.tokens.append(token)
            self.streamed[engine].append(token)
            yield token
        if engine == "speculative":
            result.tokens = [replace(t, kind=TokenKind.BONUS if i % 3 == 2 else TokenKind.ACCEPTED, step=i // 3,
                                     position=i % 3) for i, t in enumerate(result.tokens)]
            result.steps = [StepRecord(s, 2, 2, 3, 0.0, 0.0, 0.01 * s) for s in range(4)]
            yield Reclassified(engine, [(t.index, t.kind, t.step, t.position) for t in result.tokens])
        result.output_text = "".join(t.text for t in result.tokens)
        result.finish_reason, result.total_s = "length", 0.12
        result.metrics = run_metrics(result)
        yield result


def test_tokens_reclassified_at_the_end_are_rewritten(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "SAVE_EVERY_S", 0.0)
    history = History(tmp_path / "h.db")
    backend = ReclassifyingBackend()
    comp = Comparison(backend, Request(prompt="x", max_new_tokens=12), "race", history, {})
    run_to_end(comp)
    assert comp.saved_events.counts[("speculative", "tokens")] == 12
    saved = db_rows(tmp_path / "h.db", "SELECT kind, step, position FROM tokens WHERE run_id = ? AND "
                                       "engine = 'speculative' ORDER BY seq", [comp.run_id])
    assert saved == [(t.kind.value, t.step, t.position) for t in comp.results["speculative"].tokens]
    assert "pending" not in {kind for kind, _, _ in saved}
    # the consumer changed its own copies: what the backend yielded is as it was yielded
    assert [t.kind for t in backend.streamed["speculative"]] == [TokenKind.PENDING] * 12


# --- two processes on one file -----------------------------------------------------------------------------------


def test_only_runs_of_ended_processes_are_interrupted(tmp_path):
    """A second console on the same file leaves the first one's live runs alone."""
    db = tmp_path / "h.db"
    code = ("import sys; from specconsole.history import History; "
            f"print(History({str(db)!r}).start_run(prompt='live'), flush=True); sys.stdin.read()")
    other = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        live = other.stdout.readline().strip()
        history = History(db)
        mine = history.start_run(prompt="mine")
        ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                               text=True, check=True)
        host, old = socket.gethostname(), (datetime.now(timezone.utc) - timedelta(days=2)).isoformat()
        rows = {  # run id -> (created_at, owner_host, owner_pid, owner_started)
            "endedpid": (None, host, int(ended.stdout), "boot:1"),  # a process that exited
            "reusedpid": (None, host, os.getpid(), "another-boot:42"),  # this pid, but not this process
            "legacy": (None, None, None, None),  # saved by a version without owners
            "elsewhere": (None, "another-host", 1, "x:1"),  # another host: cannot be checked, recent
            "elsewhereold": (old, "another-host", 1, "x:1"),  # another host, two days "running"
        }
        for run_id, (created, owner_host, pid, started) in rows.items():
            history.db["runs"].insert({"id": run_id, "created_at": created or datetime.now(timezone.utc).isoformat(),
                                       "status": "running", "owner_host": owner_host, "owner_pid": pid,
                                       "owner_started": started})
        assert history.run(live)["owner_pid"] == other.pid
        assert history.run(mine)["owner_started"] == process_start(os.getpid())

        second = History(db)  # a second console starts on the same file
        status = {r["id"]: r["status"] for r in second.runs()}
        assert status[live] == "running" and status[mine] == "running" and status["elsewhere"] == "running"
        for gone in ("endedpid", "reusedpid", "legacy", "elsewhereold"):
            assert status[gone] == "interrupted", gone
    finally:
        other.stdin.close()
        other.wait(30)
    assert History(db).run(live)["status"] == "interrupted"  # its process has ended now


# --- a full disk -------------------------------------------------------------------------------------------------


def test_full_database_mid_run_keeps_the_run_on_screen_and_the_history(backend, tmp_path, monkeypatch):
    """SQLITE_FULL for real: PRAGMA max_page_count on the console's own connection stops the file from growing in
    the middle of a run."""
    monkeypatch.setattr(runner, "SAVE_EVERY_S", 0.0)
    db = tmp_path / "h.db"
    history = History(db)
    meta = {"category": "code", "backend": "local", "method": "draft"}

    def comparison(max_new):
        return Comparison(backend, Request(prompt="def add(a, b):", max_new_tokens=max_new,
                                           drafting=Drafting(method="draft", k=3)),
                      "fair", history, meta)

    first = comparison(24)
    run_to_end(first)
    before = db_rows(db, "SELECT * FROM tokens WHERE run_id = ? ORDER BY engine, seq", [first.run_id])

    second = comparison(180)
    second.start()
    while not second.saved_events.counts:  # until its first events are in the file
        second.poll(0.005)
    pages = history.db.execute("PRAGMA page_count").fetchone()[0]
    history.db.execute(f"PRAGMA max_page_count = {pages}")  # no page more: the next growth fails
    run_to_end(second, start=False)  # started above
    assert second.save_error and "database or disk is full" in second.save_error
    shown = second.results
    assert len(shown["baseline"].output_tokens) == 180 and len(shown["speculative"].output_tokens) == 180
    assert second.comparison().identical is True

    third = comparison(16)  # starts while the file is still full (its small first row may still fit)
    run_to_end(third)
    assert "database or disk is full" in third.save_error
    assert len(third.results["baseline"].output_tokens) == 16

    history.db.execute("PRAGMA max_page_count = 1073741823")  # room again
    fourth = comparison(16)
    run_to_end(fourth)
    assert fourth.save_error is None and history.run(fourth.run_id)["status"] == "completed"
    assert db_rows(db, "SELECT * FROM tokens WHERE run_id = ? ORDER BY engine, seq", [first.run_id]) == before
    for run in (second, third):
        row = history.run(run.run_id) if run.run_id else None
        assert row is None or (row["status"] == "interrupted" and "database or disk is full" in row["error"])
    assert history.run(second.run_id)["status"] == "interrupted"
    partial = history.results(second.run_id)["baseline"].tokens
    assert 0 < len(partial) < 180
    assert [t.text for t in partial] == [t.text for t in shown["baseline"].tokens[:len(partial)]]
    assert db_rows(db, "PRAGMA integrity_check") == [("ok",)]


# --- text that is not ASCII --------------------------------------------------------------------------------------


def _parse(html: str) -> tuple[set[str], str]:
    """The elements in a piece of HTML, and its text as a browser reads it."""
    from html.parser import HTMLParser

    class Parser(HTMLParser):
        tags, text = set(), []

        def handle_starttag(self, tag, attrs):
            self.tags.add(tag)

        def handle_data(self, data):
            self.text.append(data)

    parser = Parser()
    parser.feed(html)
    return parser.tags, "".join(parser.text)


def _recorder(tokenizer, max_new=400):
    return _Recorder("speculative", "scripted", tokenizer, [], StopConditions(max_new), time.perf_counter)


def test_characters_split_over_tokens_commit_whole(smol_tokenizer):
    ids = smol_tokenizer.encode(UNICODE_TEXT, add_special_tokens=False)
    alone = [smol_tokenizer.decode([i]) for i in ids]
    assert sum("\ufffd" in a for a in alone) >= 3, "the text no longer splits a character over tokens"
    run = _recorder(smol_tokenizer)
    pieces = [run.commit(TokenKind.ACCEPTED, i, 0, 0).text for i in ids]
    assert "".join(pieces) == UNICODE_TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_rejected_drafts_decode_after_the_committed_text(smol_tokenizer):
    parrot = smol_tokenizer.encode(PARROT, add_special_tokens=False)
    assert len(parrot) == 3
    run = _recorder(smol_tokenizer)
    for i in smol_tokenizer.encode("Look:", add_special_tokens=False):
        run.commit(TokenKind.BASELINE, i, 0, 0)
    # the whole character drafted and rejected
    assert [run.reject(i, 1, n).text for n, i in enumerate(parrot)] == ["", "", PARROT]
    # its first byte accepted (held back), the rest rejected: the rejected draft completes it, in place
    assert run.commit(TokenKind.ACCEPTED, parrot[0], 2, 0).text == ""
    assert [run.reject(i, 2, n).text for n, i in enumerate(parrot[1:], 1)] == ["", PARROT]
    # and the target's own ending of the step commits the character whole
    assert run.commit(TokenKind.RECOVERED, parrot[1], 2, 1).text + run.commit(TokenKind.ACCEPTED, parrot[2], 3, 0).text \
        == PARROT


class ParrotProposer:
    """Always drafts the three byte tokens of one emoji; the tiny random target rejects them."""

    method = "scripted"

    def __init__(self, ids):
        self.ids = ids

    def propose(self, ids, k, stop=None):
        return Proposal(self.ids[:k], None)


def test_engine_shows_a_rejected_split_character_once(tiny_chat_pair, smol_tokenizer):
    target, _ = tiny_chat_pair
    parrot = smol_tokenizer.encode(PARROT, add_special_tokens=False)
    prompt = smol_tokenizer.encode("Say a bird.", add_special_tokens=False)
    events = list(generate_speculative(target, smol_tokenizer, ParrotProposer(parrot), prompt, SamplingParams(),
                                       StopConditions(30), SpecPolicy(PolicyConfig(k=3))))
    result = events[-1]
    steps = {}
    for t in result.tokens:
        if t.kind == TokenKind.REJECTED:
            steps.setdefault(t.step, []).append(t.text)
    whole = [texts for texts in steps.values() if len(texts) == 3]
    assert whole, "no step rejected all three drafts"
    for texts in whole:  # never three U+FFFD pieces: two empty, then the character
        assert texts[:2] == ["", ""] and texts[2].endswith(PARROT), texts
    assert result.output_text == "".join(t.text for t in result.output_tokens)


def test_unicode_round_trips_through_history_and_csv(tmp_path, smol_tokenizer):
    """Real tokenizer pieces (including a character rejected across drafts) in, the same text out of the panel
    HTML, the database and both CSV files."""
    run = _recorder(smol_tokenizer)
    ids = smol_tokenizer.encode(UNICODE_TEXT, add_special_tokens=False)
    for n, i in enumerate(ids):
        run.commit(TokenKind.ACCEPTED if n % 3 else TokenKind.BONUS, i, n, 0)
        if n == 5:
            for j, p in enumerate(smol_tokenizer.encode(" " + PARROT, add_special_tokens=False)):
                run.reject(p, n, j + 1)
    result = run.finish()
    history = History(tmp_path / "h.db")
    run_id = history.start_run(prompt=UNICODE_TEXT, category="chat")
    history.finish_run(run_id, "completed", {"speculative": result}, ComparisonFigures())

    html = tokens_html(result.tokens)
    tags, text = _parse(html)
    assert tags <= {"div", "span", "del"}, tags  # the markup in the text stayed text
    assert text == "".join(t.text or "\u200b" for t in result.tokens)  # an empty piece shows as a zero-width space
    assert "\ufffd" not in text and PARROT in text
    assert 'style="unicode-bidi:isolate"' in html  # the right-to-left override stays inside its token

    rebuilt = history.results(run_id)["speculative"]
    assert [t.to_dict() for t in rebuilt.tokens] == [t.to_dict() for t in result.tokens]
    assert rebuilt.output_text == UNICODE_TEXT == "".join(t.text for t in rebuilt.output_tokens)

    summary, tokens = export_csv(history, tmp_path / "csv")
    with open(tokens, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["text"] for r in rows] == [neutralise(t.text) or "" for t in result.tokens]
    with open(summary, newline="", encoding="utf-8") as f:
        (row,) = list(csv.DictReader(f))
    assert row["speculative_output"] == UNICODE_TEXT and row["prompt"] == UNICODE_TEXT


# --- a long history ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "history.db"
    return path, big_history_copy(path)


def vm_steps(history: History, read) -> tuple[object, int, list[str]]:
    """What `read()` returns, how many SQLite virtual-machine steps it took (a count of the work, whatever the
    machine's speed) and the statements it ran, parameters filled in."""
    steps, statements = [0], []

    def step():
        steps[0] += 1
        return 0  # go on

    history.db.conn.set_progress_handler(step, 1)
    history.db.conn.set_trace_callback(statements.append)
    try:
        result = read()
    finally:
        history.db.conn.set_progress_handler(None, 1)
        history.db.conn.set_trace_callback(None)
    return result, steps[0], [s for s in statements if s.lstrip().upper().startswith("SELECT")]


def test_history_pages_open_and_filter_fast(big):
    """The History tab reads one page (and a count) from the indexes, whatever the history's length: each page is
    two queries, each answered from an index without a sort, and the work (SQLite's VM steps) is a small part of
    one pass over the listed columns of every run. The times (milliseconds) are logged, not asserted: the tab's
    1 s is asserted in Chromium (tests/test_browser_faults.py)."""
    path, counts = big
    history = History(path)
    _, whole, _ = vm_steps(history, lambda: history.db.execute(
        f"SELECT {', '.join(LIST_COLUMNS)}, substr(prompt, 1, 80) FROM runs").fetchall())
    timings = {}
    for label, category, page in (("all, page 1", None, 1), ("code, page 1", "code", 1),
                                  ("code, last page", "code", 10_000), ("all, page 50", None, 50)):
        start = time.perf_counter()
        history.page(category, page, 100)
        timings[label] = time.perf_counter() - start  # (without the counting below, which slows SQLite down)
        (rows, total, shown), steps, statements = vm_steps(history, lambda: history.page(category, page, 100))
        assert rows and total == (counts["runs"] if category is None else -(-counts["runs"] // 6))
        assert all(r["category"] == category for r in rows) if category else True
        assert len(statements) == 2, statements  # the count and the page
        for sql in statements:  # both from an index: no scan of the table, no sort
            plan = " ".join(r[3] for r in history.db.execute("EXPLAIN QUERY PLAN " + sql))
            assert "INDEX" in plan and "TEMP B-TREE" not in plan, (sql, plan)
        # a first page (what the tab opens on) under a tenth of that pass, a page far down under a quarter
        assert steps < whole / (10 if page == 1 else 4), (label, steps, whole)
    log.info("history of %d runs: page queries took %s (reading every run's listed columns: %d VM steps)",
             counts["runs"], ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in timings.items()), whole)


def test_deleting_1000_runs_is_one_transaction(tmp_path):
    path = tmp_path / "history.db"
    counts = make_big_history(path, runs=2_000)  # a history of its own: the 10,000-run one is the slow tier's
    history = History(path)
    ids = [r[0] for r in history.db.execute("SELECT id FROM runs ORDER BY created_at LIMIT 1000")]
    keep = history.db.execute("SELECT count(*) FROM tokens WHERE run_id NOT IN (SELECT value FROM json_each(?))",
                              [json.dumps(ids)]).fetchone()[0]
    statements = []
    history.db.conn.set_trace_callback(statements.append)
    start = time.perf_counter()
    history.delete(ids)
    seconds = time.perf_counter() - start
    history.db.conn.set_trace_callback(None)
    log.info("deleting 1000 of %d runs (with their events) took %.2f s", counts["runs"], seconds)
    verbs = [s.split()[0].upper() for s in statements]
    assert verbs.count("BEGIN") == 1 and verbs.count("COMMIT") == 1, statements
    assert verbs.index("BEGIN") < min(i for i, v in enumerate(verbs) if v == "DELETE") and verbs[-1] == "COMMIT"
    assert db_rows(path, "SELECT count(*) FROM runs") == [(counts["runs"] - 1000,)]
    for table in ("tokens", "steps", "policy"):
        assert db_rows(path, f"SELECT count(*) FROM {table} WHERE run_id IN (SELECT value FROM json_each(?))",
                       [json.dumps(ids)]) == [(0,)]
    assert db_rows(path, "SELECT count(*) FROM tokens") == [(keep,)]


EXPORT_SCRIPT = """
import json, sys
from pathlib import Path
from specconsole.export import export_csv
from specconsole.history import History

def peak():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024

history = History(sys.argv[1])
before = peak()
summary, tokens = export_csv(history, Path(sys.argv[2]))
print(json.dumps({"before": before, "after": peak(), "tokens_csv": tokens.stat().st_size}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc")
def test_export_of_everything_streams_in_bounded_memory(big, tmp_path):
    """Every token row (about 4 million) to CSV, in a process of its own whose peak RSS is read before and after."""
    path, counts = big
    for table in ("runs", "tokens"):  # whole: no other test changed the module's history
        assert db_rows(path, f"SELECT count(*) FROM {table}") == [(counts[table],)]
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", EXPORT_SCRIPT, str(path), str(tmp_path)], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    seconds = time.perf_counter() - start
    m = json.loads(out.stdout.strip().splitlines()[-1])
    grew = m["after"] - m["before"]
    log.info("export of %d runs / %d token rows: tokens CSV %.0f MB, peak RSS %.0f MB -> %.0f MB (+%.1f MB), %.0f s",
             counts["runs"], counts["tokens"], m["tokens_csv"] / 2**20, m["before"] / 2**20, m["after"] / 2**20,
             grew / 2**20, seconds)
    newlines = db_rows(path, "SELECT sum(length(text) - length(replace(text, char(10), ''))) FROM tokens")[0][0]
    with open(tmp_path / "specconsole_tokens.csv", "rb") as f:  # a row per line, plus the newlines in the texts
        assert sum(1 for _ in f) == 1 + counts["tokens"] + newlines
    with open(tmp_path / "specconsole_runs.csv", newline="", encoding="utf-8") as f:
        assert sum(1 for _ in csv.DictReader(f)) == counts["runs"]
    # generous: a tenth of the file it wrote (a whole-table DataFrame would take several times the file)
    assert grew < max(64 * 2**20, m["tokens_csv"] / 10), m


def test_steps_keep_their_drafter_and_an_older_history_gains_the_column(tmp_path):
    path = tmp_path / "h.db"
    history = History(path)
    run_id = history.start_run(method="hybrid")
    r = RunResult(engine="speculative", method="hybrid", prompt_tokens=1)
    r.steps = [StepRecord(0, 0, 0, 1, 0.0, 1.0, 0.1), StepRecord(1, 3, 2, 3, 1.0, 2.0, 0.2, "ngram", 1)]
    r.policy = [PolicyEvent(1, PolicyAction.FALLBACK, 0, "why", 0.2)]
    history.finish_run(run_id, "completed", {"speculative": r}, ComparisonFigures())
    back = history.results(run_id)["speculative"]
    assert [s.drafter for s in back.steps] == ["", "ngram"]
    assert [s.ignored for s in back.steps] == [None, 1]  # not known for the first (as from a server), 1 ignored
    assert back.policy[0].action is PolicyAction.FALLBACK
    assert list(history.db.execute("SELECT action FROM policy")) == [("fallback",)]  # the plain string, as before
    history.db.conn.close()
    conn = sqlite3.connect(path)  # a history saved before steps had a drafter
    conn.execute("ALTER TABLE steps DROP COLUMN drafter")
    conn.execute("ALTER TABLE steps DROP COLUMN ignored")
    conn.commit()
    conn.close()
    history = History(path)
    steps = history.results(run_id)["speculative"].steps
    assert [s.drafter for s in steps] == ["", ""] and [s.ignored for s in steps] == [None, None]


def test_run_ids_read_back_from_csv_as_text(tmp_path):
    """A hex id such as 8451076e9647 (or one of digits only) is a number to pandas and to spreadsheets: the CSV
    export's ids would come back as inf. About 1 id in 120 looked like that; 600 ids catch the old format."""
    history = History(tmp_path / "h.db")
    ids = [history.start_run(prompt="p", mode="fair", settings={}) for _ in range(600)]
    # each on its own, as the export of one selected run (in a column of many, one text id keeps them all text)
    assert all(isinstance(pd.read_csv(io.StringIO(f"id\n{i}\n"))["id"][0], str) for i in ids)
