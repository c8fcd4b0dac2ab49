"""Bounds on what one request may ask for (engine.limits) and Stop for every long job.

Each out-of-range value is refused with a message that names the value and the limit, before any run starts (the
history gets no run, the servers see no request, the host lock is not taken); a suite or concurrency sweep stopped
mid-way ends as cancelled after the requests already made. The vLLM side is a real HTTP server on 127.0.0.1 that
counts the completions it is asked for."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import astuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import gradio as gr
import pytest

from engine import limits
from engine.request import Request, build_request
from engine.limits import SettingsError
from engine.vllm.backend import VLLMBackend
from specconsole import backends
from specconsole.history import History
from specconsole.host import ModelHost
from specconsole.run_form import RunForm
from specconsole.run_queue import RunQueue
from specconsole.suite_job import SuiteJob
from specconsole.suites import SuitePrompt, load_file
from specconsole.workbench import run_suite

ITEMS = [SuitePrompt("code", "def add(a, b):"), SuitePrompt("code", "print('hello')")]
# the tiny model's context is 256 tokens: this prompt does not fit
TOO_LONG = SuitePrompt("code", "word " * 400)
HANG_GUARD_S = 60  # only against a hang: a passing test never waits for it


class CountingServer(ThreadingHTTPServer):
    """A vLLM-like server: each chat completion answers 3 tokens (non-streamed, as the concurrency sweep asks) and is
    counted; with `hold` set it keeps every answer back until `release` is set; `on_request` runs on each."""

    daemon_threads = True

    def __init__(self, hold: bool = False, on_request=None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hold, self.on_request = hold, on_request
        self.release = threading.Event()
        self.requests = 0
        self.count_lock = threading.Lock()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request, client_address):
        pass  # a client that gave up (Stop) closes the connection before the held answer goes out


class _Handler(BaseHTTPRequestHandler):
    server: CountingServer

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.count_lock:
            self.server.requests += 1
            n = self.server.requests
        if self.server.on_request:
            self.server.on_request(n)
        if self.server.hold:
            self.server.release.wait(HANG_GUARD_S)
        body = json.dumps({"usage": {"prompt_tokens": 4, "completion_tokens": 3}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server_factory():
    started = []

    def make(**kw) -> CountingServer:
        s = CountingServer(**kw)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.release.set()
        s.shutdown()
        s.server_close()


def vllm(server: CountingServer, max_model_len: int = 2048) -> VLLMBackend:
    return VLLMBackend(server.url, server.url, "m", max_model_len=max_model_len)


def ready_host(backend) -> ModelHost:
    host = ModelHost("test", lambda progress: backend).start()
    assert host.wait(HANG_GUARD_S)
    return host


# --- SuiteJob.check: every value against engine.limits, before anything runs ----------------------------------------

SUITE_CASES = {
    "K sweep value": dict(variable="k", values=["4", "1000"], match=r"K .*32, got 1000"),
    "temperature sweep value": dict(variable="temperature", values=["9"], match=r"temperature .*5.0, got 9"),
    "sweep value not a number": dict(variable="k", values=["lots"], match=r"'lots'"),
    "too many sweep values": dict(variable="k", values=[str(k) for k in range(1, 14)],
                                  match=r"sweep values .*12, got 13"),
    "unknown sweep method": dict(variable="method", values=["draft", "magic"], match=r"'magic'"),
    "unknown context value": dict(variable="context", values=["huge"], match=r"'huge'"),
    "repeats": dict(repeats=21, match=r"repeats .*20, got 21"),
    "no repeats": dict(repeats=0, match=r"repeats .*got 0"),
    "max new tokens": dict(base=build_request("", max_new_tokens=100_000), match=r"max new tokens .*4096, got 100000"),
    # only the first prompt was checked: a later one too long for the model's context failed mid-suite
    "a later prompt too long": dict(items=[ITEMS[0], TOO_LONG], match=r"context of 256"),
    # the long-context sweep value puts a document before each prompt: too long for this model
    "long context sweep value": dict(variable="context", values=["short", "long"], match=r"context of 256"),
}


@pytest.mark.parametrize("case", SUITE_CASES, ids=list(SUITE_CASES))
def test_suite_job_refuses_out_of_range_values_before_any_run(backend, tmp_path, case):
    kw = dict(SUITE_CASES[case])
    match, items, base = kw.pop("match"), kw.pop("items", ITEMS), kw.pop("base", build_request("", max_new_tokens=4))
    history = History(tmp_path / "h.db")
    job = SuiteJob(backend, history, items, base, **kw)
    with pytest.raises(SettingsError, match=match):
        job.check()
    assert history.runs() == []


@pytest.mark.parametrize("levels, match", [(["65"], r"concurrency .*64, got 65"), (["0"], r"concurrency .*got 0"),
                                           ([str(n) for n in range(1, 14)], r"sweep values .*12, got 13")])
def test_concurrency_sweep_refuses_levels_before_any_request(server_factory, levels, match):
    server = server_factory()
    job = SuiteJob(vllm(server), None, ITEMS, build_request("", max_new_tokens=4), variable="concurrency",
                   values=levels)
    with pytest.raises(SettingsError, match=match):
        job.check()
    assert server.requests == 0


def test_vllm_refuses_more_new_tokens_than_its_context(server_factory):
    """The server's max_model_len bounds prompt and answer together: more new tokens than that cannot be served."""
    server = server_factory()
    with pytest.raises(SettingsError, match=r"300 new tokens.*context of 256"):
        vllm(server, max_model_len=256).validate(Request(prompt="x", max_new_tokens=300))
    vllm(server, max_model_len=256).validate(Request(prompt="x", max_new_tokens=200))
    assert server.requests == 0


def test_a_suite_file_over_the_upload_limit_is_refused_unread(tmp_path):
    big = tmp_path / "big.jsonl"
    line = json.dumps({"prompt": "x" * 1000}) + "\n"
    big.write_text(line * (limits.MAX_UPLOAD_BYTES // len(line) + 1))
    with pytest.raises(SettingsError, match=r"big.jsonl is 5\.0 MB.*limit of 5\.0 MB"):
        load_file(big)
    small = tmp_path / "small.jsonl"
    small.write_text(line * 3)
    assert len(load_file(small)) == 3


# --- the Workbench page: refused before the host lock is taken ------------------------------------------------------

def page_fn(host, history, name: str):
    """A handler of the Run or Workbench tab, as the page registers it (the tabs that hold these limits only)."""
    from specconsole import tab_run, tab_workbench

    with gr.Blocks() as app:
        with gr.Tab("Run"):
            run = tab_run.build(app, host, history)
        with gr.Tab("Workbench") as workbench:
            tab_workbench.build(host, history, workbench, run.settings)
    return next(f for f in app.fns.values() if f.name == name)


PAGE_CASES = {
    "prompts per suite": dict(n=501, match=r"prompts per suite .*500, got 501"),
    "repeats": dict(repeats=21, match=r"repeats .*20, got 21"),
    "K sweep value": dict(variable="k", values="1,1000", match=r"K .*32, got 1000"),
    "too many sweep values": dict(variable="temperature", values=",".join(["0.1"] * 13),
                                  match=r"sweep values .*12, got 13"),
    "max new tokens": dict(max_tokens=100_000, match=r"max new tokens .*4096, got 100000"),
}


@pytest.mark.parametrize("case", PAGE_CASES, ids=list(PAGE_CASES))
def test_workbench_page_refuses_before_taking_the_host_lock(backend, tmp_path, case):
    kw = dict(PAGE_CASES[case])
    match = kw.pop("match")
    history = History(tmp_path / "h.db")
    host = ready_host(backend)
    fn = page_fn(host, history, "run_suite_ui").fn
    args = dict(cats_chosen=["code"], upload=None, n=1, max_tokens=4, variable="none", values="", method="draft",
                k=4, dynamic_k=False, confidence=0.0, draft_vocab=0, fallback=False, top_p=1.0, seed=0, mode="fair",
                repeats=1) | kw
    gen = fn(**args, request=gr.Request(session_hash="w"))
    try:
        first = next(gen)
        locked = host.lock.locked()  # a refusal comes before the lock; a started suite holds it
    finally:
        gen.close()
    assert not locked and "panel-error" in first[0]
    assert re.search(match, first[0]), first[0]
    assert history.runs() == []


def test_workbench_page_refuses_an_oversized_upload(backend, tmp_path):
    big = tmp_path / "mine.csv"
    big.write_text("prompt\n" + ("y" * 999 + "\n") * (limits.MAX_UPLOAD_BYTES // 1000 + 1))
    history = History(tmp_path / "h.db")
    host = ready_host(backend)
    fn = page_fn(host, history, "run_suite_ui").fn
    gen = fn(cats_chosen=[], upload=str(big), n=1, max_tokens=4, variable="none", values="", method="draft", k=4,
             dynamic_k=False, confidence=0.0, draft_vocab=0, fallback=False, top_p=1.0, seed=0, mode="fair",
             repeats=1, request=gr.Request(session_hash="u"))
    first = next(gen)
    gen.close()
    assert "mine.csv is 5.0 MB" in first[0] and history.runs() == []


# --- the Run tab: a bounded number of runs wait -----------------------------------------------------------------------

# a small run's form values, in RunForm's order, as the page sends them
RUN_FORM = astuple(RunForm(prompt="hello", category="code", method="draft", k=2, dynamic_k=False, confidence=0.0,
                           draft_vocab=0, fallback=False, temperature=0.0, top_p=1.0, max_new=4, seed=0, mode="fair",
                           show_rejected=False, compare_with=[]))


def test_run_tab_refuses_a_run_beyond_the_waiting_limit(backend, tmp_path):
    history = History(tmp_path / "h.db")
    host = ready_host(backend)
    run = page_fn(host, history, "run")
    # the handler must be reachable by one more run than may wait, or gradio queues the extra ones unseen
    assert run.concurrency_limit >= limits.MAX_QUEUED_RUNS + 2
    waiting = []
    host.lock.acquire()  # a run in progress
    try:
        for i in range(limits.MAX_QUEUED_RUNS):
            gen = run.fn(*RUN_FORM, request=gr.Request(session_hash=f"s{i}"))
            assert "Queued behind another run" in str(next(gen))
            waiting.append(gen)
        extra = run.fn(*RUN_FORM, request=gr.Request(session_hash="one-too-many"))
        refusal = str(next(extra))
        assert f"{limits.MAX_QUEUED_RUNS} runs are already waiting" in refusal
        with pytest.raises(StopIteration):
            next(extra)
    finally:
        for gen in waiting:
            gen.close()
        host.lock.release()
    assert history.runs() == []


def test_a_run_whose_comparison_cannot_start_frees_the_engines(backend, tmp_path, monkeypatch):
    """An engine process that dies between the check and the start (describe() fails) leaves the engines free."""
    history = History(tmp_path / "h.db")
    host = ready_host(backend)
    run = page_fn(host, history, "run")

    def dead():
        raise RuntimeError("the engine process has died")
    monkeypatch.setattr(backend, "describe", dead)
    with pytest.raises(RuntimeError, match="has died"):
        list(run.fn(*RUN_FORM, request=gr.Request(session_hash="s")))
    assert not host.lock.locked()


def test_the_run_queue_frees_the_engines_when_a_run_cannot_start():
    """A turn taken at once yields nothing; a comparison that fails to start still gives the engines back."""
    lock = threading.Lock()
    queue = RunQueue(lock)
    with pytest.raises(StopIteration) as taken:
        next(queue.take_turn("s", "run1", ["baseline", "speculative"]))
    assert taken.value.value is True and lock.locked()

    def broken():
        raise SettingsError("cannot start")
    with pytest.raises(SettingsError):
        with queue.run("s", broken):
            pass
    assert not lock.locked() and queue.running == {}


# --- launch.py suite: the same values, exit code 2 ----------------------------------------------------------------

CLI_CASES = {  # refused before the models load
    "repeats": ["--repeats", "21"],
    "prompts per suite": ["--prompts", "501"],
    "K sweep value": ["--sweep", "k", "--values", "2,1000"],
    "too many sweep values": ["--sweep", "k", "--values", ",".join(["2"] * 13)],
    "concurrency level": ["--sweep", "concurrency", "--values", "65"],
    "max new tokens": ["--max-new-tokens", "100000"],
}


@pytest.mark.parametrize("case", CLI_CASES, ids=list(CLI_CASES))
def test_cli_suite_refuses_with_exit_code_2_before_loading(backend, tmp_path, monkeypatch, caplog, case):
    import launch

    loaded = []
    monkeypatch.setattr(backends, "local_host", lambda args: ModelHost("tiny", lambda p: loaded.append(1) or backend))
    db = tmp_path / "h.db"
    argv = ["suite", "--category", "code", "--prompts", "1", "--max-new-tokens", "4", "--db", str(db), "--out",
            str(tmp_path / "runs.csv")] + CLI_CASES[case]
    assert launch.main(argv) == 2
    assert loaded == [] and not db.exists()
    assert "limit" in caplog.text or "between" in caplog.text


def test_cli_suite_refuses_a_prompt_too_long_for_the_context(backend, tmp_path, monkeypatch):
    import launch

    monkeypatch.setattr(backends, "local_host", lambda args: ModelHost("tiny", lambda p: backend))
    suite_file = tmp_path / "mine.jsonl"
    suite_file.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": TOO_LONG.prompt}) + "\n")
    db = tmp_path / "h.db"
    assert launch.main(["suite", "--file", str(suite_file), "--max-new-tokens", "4", "--db", str(db), "--out",
                        str(tmp_path / "runs.csv")]) == 2
    assert not db.exists() or History(db).runs() == []


def test_cli_suite_refuses_an_oversized_file(tmp_path):
    import launch

    big = tmp_path / "big.jsonl"
    line = json.dumps({"prompt": "x" * 1000}) + "\n"
    big.write_text(line * (limits.MAX_UPLOAD_BYTES // len(line) + 1))
    assert launch.main(["suite", "--file", str(big), "--db", str(tmp_path / "h.db")]) == 2


def test_cli_demo_refuses_before_loading(backend, monkeypatch):
    import launch

    loaded = []
    monkeypatch.setattr(backends, "local_host", lambda args: ModelHost("tiny", lambda p: loaded.append(1) or backend))
    assert launch.main(["demo", "--prompt", "hi", "--max-new-tokens", "100000"]) == 2
    assert loaded == []


# --- Stop ------------------------------------------------------------------------------------------------------------

def test_throughput_stops_waiting_on_cancel(server_factory):
    """All requests sent, the server holds the answers: cancel ends the burst without them."""
    arrived = threading.Event()
    n = 4
    server = server_factory(hold=True, on_request=lambda i: i == n and arrived.set())
    cancel = threading.Event()
    out = {}
    worker = threading.Thread(target=lambda: out.update(r=vllm(server).throughput("baseline", ["a"] * n, 4, cancel)),
                              daemon=True)
    worker.start()
    assert arrived.wait(HANG_GUARD_S)
    cancel.set()
    worker.join(HANG_GUARD_S)
    assert not worker.is_alive() and not server.release.is_set()  # ended while the server still held every answer
    assert out["r"][0] == 0 and server.requests == n


def test_concurrency_sweep_stopped_mid_way_ends_cancelled(server_factory):
    """Stop during the first level's burst: no further level or engine is asked for."""
    holder = {}
    server = server_factory(on_request=lambda i: holder["job"].cancel.set())
    job = SuiteJob(vllm(server), None, ITEMS, build_request("", max_new_tokens=4), variable="concurrency",
                   values=["2", "4", "8"])
    holder["job"] = job
    job.check()
    assert job.start().wait(HANG_GUARD_S) and job.error is None
    assert job.cancelled and server.requests <= 2  # the first burst only (its two requests go out together)
    assert job.concurrency is not None and job.concurrency.empty


def test_concurrency_sweep_runs_every_level_without_stop(server_factory):
    server = server_factory()
    job = SuiteJob(vllm(server), None, ITEMS, build_request("", max_new_tokens=4), variable="concurrency",
                   values=["1", "3"])
    job.check()
    assert job.start().wait(HANG_GUARD_S) and job.error is None and not job.cancelled
    assert server.requests == 2 * (1 + 3) and list(job.concurrency["concurrency"]) == [1, 3]


def test_suite_stopped_mid_way_keeps_the_runs_before_stop(backend, tmp_path):
    history = History(tmp_path / "h.db")
    cancel = threading.Event()
    base = build_request("", max_new_tokens=4, k=2, method="draft")
    result = run_suite(backend, ITEMS * 3, base, history, {}, cancel=cancel,
                       on_progress=lambda done, total, what: cancel.set())
    assert result.cancelled and len(result.run_ids) == 1
    assert [r["status"] for r in history.runs(suite_id=result.suite_id)] == ["completed"]

