"""The llamacpp backend on real llama.cpp (the pinned xllamacpp wheel) and real GGUF weights: SmolLM2-135M for speed,
the default Qwen2.5-Coder pair for one end-to-end run. Engines run on one thread each, so that a busy machine slows
them down without changing what they compute."""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pandas as pd
import pytest

from engine.backend import Backend
from engine.analysis.check import sampling_check
from engine.events import Reclassified, RunResult, TokenEvent, TokenKind
from engine.llamacpp.backend import DIVERGENCE_NOTE, LlamaCppBackend
from engine.llamacpp.server import EngineConfig, LlamaCppEngine, LlamaCppError, check_build, parse_method
from engine.metrics import compare
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.loading.weights import gguf_model

pytestmark = pytest.mark.llamacpp

PROMPTS = ["Repeat exactly: alpha beta gamma delta, alpha beta gamma delta",
           "Write a Python function `merge_sorted(a, b)` that merges two sorted lists.",
           "Summarize in one sentence: The cat sat on the mat. The cat was happy. The mat was red."]


@pytest.fixture(scope="module")
def smol() -> str:
    return str(gguf_model("smollm2-135m-instruct")[0])


@pytest.fixture(scope="module")
def managed(smol, tmp_path_factory):
    """Baseline, a draft-model engine (SmolLM2 drafting for itself, K=4) and an n-gram one (speculative-2)."""
    backend = LlamaCppBackend.managed(EngineConfig("speculative", smol, "draft", draft=smol, k=4, threads=1),
                                      [EngineConfig("x", smol, "ngram-simple", k=4, ngram_n=2, threads=1)],
                                      log_dir=tmp_path_factory.mktemp("llamacpp"))
    yield backend
    backend.close()


def run(stream) -> tuple[list, RunResult]:
    events = list(stream)
    assert isinstance(events[-1], RunResult)
    return events[:-1], events[-1]


def test_greedy_baseline_vs_speculative_through_the_protocol(managed):
    assert isinstance(managed, Backend)
    assert managed.variants() == {"speculative-2": {"label": "llama.cpp ngram-simple K=4 N=2",
                                                    "method": "ngram-simple"}}
    for prompt in PROMPTS:
        req = Request(prompt=prompt, max_new_tokens=24)
        _, base = run(managed.baseline(req))
        for engine in ("speculative", "speculative-2"):
            events, spec = run(managed.speculative(req, engine=engine))
            assert base.error is None and spec.error is None
            assert spec.finish_reason in ("length", "eos") and len(spec.output_ids) <= 24
            c = compare(base, spec, greedy=True)
            b, s = base.output_ids, spec.output_ids
            differ = [i for i in range(max(len(b), len(s))) if i >= min(len(b), len(s)) or b[i] != s[i]]
            assert c.identical == (not differ) and c.first_divergence == (differ[0] if differ else None)
            assert spec.metrics.divergence_note == DIVERGENCE_NOTE
            # streamed as they came: one event per token, every kind final, nothing to reclassify
            tokens = [e for e in events if isinstance(e, TokenEvent)]
            assert [t.token_id for t in tokens] == spec.output_ids
            assert not any(isinstance(e, Reclassified) for e in events)
            assert all(t.kind != TokenKind.PENDING and not t.provisional for t in tokens)
            assert base.metrics.tokens_per_s > 0 and spec.metrics.tokens_per_s > 0


def test_the_page_updates_a_whole_run_turn_only_every_few_seconds(managed):
    """In fair mode llama.cpp's servers take turns of a whole run each, so every update the page sends lands in a
    timed run (docs/page-cost.md: at two a second the plain server ran at 0.95 of its API speed in the page): the
    page's updates come at most one per PANEL_IN_WHOLE_RUN_S until the run ends, and the panels say so."""
    from specconsole.run_stream import PANEL_IN_WHOLE_RUN_S, stream
    from specconsole.runner import Comparison

    comp = Comparison(managed, Request(prompt="Count from 1 to 200, one number per line.", max_new_tokens=400),
                      "fair", None, {})
    assert comp.strategy == "sequential"
    sent, feeds = [], []
    for update in stream(comp, "r", "fair", show_rejected=False):
        sent.append(time.monotonic())
        feeds.append(update[0])
    results = comp.results
    assert all(r.finish_reason and r.error is None for r in results.values())
    gaps = [b - a for a, b in zip(sent, sent[1:-1])]  # the last one is the run's end
    assert gaps, f"the run ({results['baseline'].total_s:.1f} s) was too short to see the pace"
    # each update is sent PANEL_IN_WHOLE_RUN_S after the last began to be built (building one takes milliseconds)
    assert min(gaps) >= PANEL_IN_WHOLE_RUN_S - 0.2
    statuses = [panel["status"] for feed in feeds[:-1] if isinstance(feed, str)
                for panel in json.loads(feed)["panels"].values()]
    running = [s for s in statuses if s.startswith("running")]  # the others: an engine that finished
    assert running and all(f"shown every {PANEL_IN_WHOLE_RUN_S:g} s" in s for s in running)


def test_marks_agree_with_the_engines_own_counts(managed):
    """What the tokens say (accepted drafts, steps, the target's own tokens) is what llama.cpp counted."""
    seen = {TokenKind.ACCEPTED: 0, TokenKind.RECOVERED: 0, TokenKind.BONUS: 0}
    for engine in ("speculative", "speculative-2"):
        for prompt in PROMPTS:
            _, r = run(managed.speculative(Request(prompt=prompt, max_new_tokens=32), engine=engine))
            m = r.metrics
            assert m.highlighting.startswith("exact")
            kinds = [t.kind for t in r.tokens]
            assert kinds.count(TokenKind.ACCEPTED) == m.accepted == m.server["accepted"]
            assert sum(s.drafted for s in r.steps) == m.drafted == m.server["drafted"]
            assert sum(s.emitted for s in r.steps) == len(r.tokens) and m.target_passes == len(r.steps)
            # and what the server's /metrics counters grew by (the managed engines run with them)
            c = m.server_counters
            assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (m.steps, m.drafted, m.accepted)
            assert c.mismatch is None and c.expected_difference is None
            for step in r.steps:
                mine = [t.kind for t in r.tokens if t.step == step.step]
                if step.drafted == 0:
                    assert mine == [TokenKind.BASELINE]
                    continue
                last = TokenKind.BONUS if step.accepted == step.drafted else TokenKind.RECOVERED
                assert mine == ([TokenKind.ACCEPTED] * step.accepted + [last])[:step.emitted]
            for kind in seen:
                seen[kind] += kinds.count(kind)
    assert all(seen.values()), seen  # the n-gram engine's drafts are refused at times: every kind occurred


def test_this_build_ignores_per_request_drafting_settings(managed):
    """Why the backend says drafting settings are not applied per request: llama.cpp takes "speculative.n_max"
    without error and still drafts its own K (4) per step."""
    url = managed.urls["speculative"]
    prompt = httpx.post(url + "/apply-template", json={"messages": [{"role": "user", "content": PROMPTS[0]}]}
                        ).json()["prompt"]
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True, "timings_per_token": True,
            "speculative.n_max": 1, "speculative.n_min": 0, "speculative.p_min": 0.0, "cache_prompt": False}
    drafted, steps = 0, []
    with httpx.stream("POST", url + "/completion", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:"):
                now = json.loads(line[5:])["timings"].get("draft_n", 0)
                if now > drafted:
                    steps.append(now - drafted)
                drafted = now
    assert max(steps) == 4
    assert managed.capabilities.per_request_drafting is False
    assert set(managed.ignored_settings(Request(prompt="x"))) >= {"method", "k"}


def test_sampling_check_scores_both_outputs_under_the_target(managed):
    req = Request(prompt=PROMPTS[2], max_new_tokens=24, sampling=SamplingParams(0.8, 0, 1.0, 7))
    results = {"baseline": run(managed.baseline(req))[1], "speculative": run(managed.speculative(req))[1]}
    scores = managed.score(req, [results["baseline"].output_ids])
    assert len(scores[0]) == len(results["baseline"].output_ids) and all(lp <= 0 for lp in scores[0])
    check = sampling_check(managed, req, results)
    assert check["sampling_check"] == "ok", check


def test_attach_to_running_servers_with_an_api_key(smol, tmp_path):
    engines = [LlamaCppEngine(EngineConfig(role, smol, method, k=4, ngram_n=2, threads=1, api_key="s3cret",
                                           parallel=2), tmp_path)
               for role, method in (("baseline", "none"), ("speculative", "ngram-simple"))]
    try:
        for engine in engines:
            engine.start()
        urls = [e.url for e in engines]
        with pytest.raises(LlamaCppError, match="401"):
            LlamaCppBackend.attach(urls)  # no key
        backend = LlamaCppBackend.attach(urls, api_key="s3cret")
        assert backend.capabilities.can_reconfigure is False and backend.memory() is None
        req = Request(prompt=PROMPTS[0], max_new_tokens=16)
        _, base = run(backend.baseline(req))
        _, spec = run(backend.speculative(req))
        assert base.error is None and spec.error is None and spec.metrics.highlighting.startswith("exact")
        assert spec.metrics.server["drafted"] > 0
        # /metrics asks for the key too; an attached server's counters are server-wide, but it served only this run
        counters = spec.metrics.server_counters
        assert counters.draft_tokens == spec.metrics.server["drafted"] and counters.mismatch is None
        assert backend.capabilities.concurrent_requests  # two slots each: the concurrency sweep runs
        tokens, seconds = backend.throughput("baseline", ["Say hi.", "Say bye."], 8)
        assert 2 <= tokens <= 16 and seconds > 0
    finally:
        for engine in engines:
            engine.stop()


def test_attach_refuses_a_server_that_does_not_speculate(managed):
    with pytest.raises(LlamaCppError, match="speculative.*does not speculate"):
        LlamaCppBackend.attach([managed.urls["baseline"], managed.urls["baseline"]])
    with pytest.raises(LlamaCppError, match="one request at a time"):
        managed.throughput("baseline", ["a"], 4)


def test_a_killed_engine_ends_the_run_with_an_error_and_keeps_its_tokens(smol, tmp_path):
    engine = LlamaCppEngine(EngineConfig("baseline", smol, threads=1), tmp_path)
    engine.start()
    backend = LlamaCppBackend({"baseline": engine.url, "speculative": engine.url}, {}, stall_timeout=20)
    try:
        events = []
        for event in backend.baseline(Request(prompt="Count from 1 to 300, separated by commas.",
                                              max_new_tokens=400)):
            events.append(event)
            if len(events) == 3:
                os.killpg(engine.proc.pid, signal.SIGKILL)  # the engine and its guard, as a crash would
        result = events[-1]
        assert result.finish_reason == "error" and "baseline llama.cpp engine" in result.error
        assert 3 <= len(result.tokens) < 400
        again = list(backend.baseline(Request(prompt="hi", max_new_tokens=4)))[-1]
        assert again.finish_reason == "error" and "ConnectError" in again.error
    finally:
        engine.stop()


class FakeLlamaServer(http.server.ThreadingHTTPServer):
    """A server on 127.0.0.1 that renders prompts and answers /completion with the lines it is given."""

    def __init__(self, lines: list[bytes]):
        lines_ = lines

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/apply-template":
                    body = json.dumps({"prompt": "rendered"}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for line in lines_:
                    self.wfile.write(line)
                    self.wfile.flush()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


def _chunk(n: int, token: int, text: str, **timings) -> bytes:
    data = {"content": text, "tokens": [token], "stop": False, "timings": {"predicted_n": n, **timings}}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


@pytest.mark.parametrize("tail, message", [
    ([b"data: {not json\n\n"], "not JSON"),
    ([b'data: {"content": "x", "tokens": "seven", "stop": false}\n\n'], "unexpected shape"),
    ([b'data: {"error": {"message": "out of memory"}}\n\n'], "out of memory"),
    ([], "ended before its last line"),
])
def test_a_malformed_stream_ends_the_run_with_a_clear_error(tail, message):
    server = FakeLlamaServer([_chunk(1, 5, "Hi", predicted_ms=1.0), *tail])
    try:
        backend = LlamaCppBackend({"baseline": server.url, "speculative": server.url}, {})
        events = list(backend.speculative(Request(prompt="x", max_new_tokens=8)))
        result = events[-1]
        assert result.finish_reason == "error" and message in result.error
        assert [t.token_id for t in result.tokens] == [5]  # what came before the bad line is kept
    finally:
        server.shutdown()


def test_counts_that_do_not_add_up_leave_tokens_pending_never_guessed():
    """A server whose drafts counts go backwards: the tokens after it are pending, the figures say why."""
    stop = b'data: {"content": "", "tokens": [], "stop": true, "stop_type": "limit", "tokens_predicted": 3,' \
           b' "tokens_evaluated": 4, "timings": {"predicted_n": 3, "draft_n": 1, "draft_n_accepted": 1}}\n\n'
    server = FakeLlamaServer([_chunk(1, 5, "a", predicted_ms=1.0),
                              _chunk(2, 6, "b", predicted_ms=2.0, draft_n=4, draft_n_accepted=2),
                              _chunk(3, 7, "c", predicted_ms=2.0, draft_n=1, draft_n_accepted=1), stop])
    try:
        backend = LlamaCppBackend({"baseline": server.url, "speculative": server.url}, {})
        result = list(backend.speculative(Request(prompt="x", max_new_tokens=8)))[-1]
        assert [t.kind for t in result.tokens] == [TokenKind.BASELINE, TokenKind.ACCEPTED, TokenKind.PENDING]
        assert result.metrics.target_passes is None and "pending" in result.metrics.highlighting
    finally:
        server.shutdown()


def test_the_page_names_the_speculative_engine_by_the_method_it_runs(tmp_path):
    """The Run tab saves a llama.cpp run's speculative engine as "llamacpp-draft", the name `launch.py demo` prints
    (specconsole.variants.choose), not as a vLLM server's."""
    import gradio as gr

    from specconsole import tab_run
    from specconsole.history import History
    from specconsole.host import ModelHost

    stop = b'data: {"content": "", "tokens": [], "stop": true, "stop_type": "limit", "tokens_predicted": 1,' \
           b' "tokens_evaluated": 2, "timings": {"predicted_n": 1}}\n\n'
    server = FakeLlamaServer([_chunk(1, 5, "a", predicted_ms=1.0), stop])
    try:
        config = EngineConfig("speculative", "t.gguf", "draft", draft="d.gguf")
        backend = LlamaCppBackend({"baseline": server.url, "speculative": server.url}, {"speculative": config})
        host = ModelHost("llama.cpp", lambda progress: backend).start()
        assert host.wait()
        history = History(tmp_path / "h.db")
        with gr.Blocks() as app:
            tab_run.build(app, host, history)
        run = next(f for f in app.fns.values() if f.name == "run").fn
        for _ in run("x", "t", "draft", 4, False, 0.0, 0, False, 0.0, 1.0, 8, 0, "race", False, [],
                     request=gr.Request(session_hash="s")):
            pass
        (saved,) = history.runs()
        assert history.engines(saved["id"])["speculative"]["label"] == "llamacpp-draft"
    finally:
        server.shutdown()


def test_a_missing_option_is_named_before_anything_starts(smol, monkeypatch):
    from engine.llamacpp import server as llamacpp_server

    check_build(EngineConfig("speculative", smol, "ngram-mod", k=4))
    monkeypatch.setitem(llamacpp_server.METHOD_OPTIONS, "ngram_mod", ("speculative.ngram_mod.n_maximum",))
    with pytest.raises(LlamaCppError, match="has no speculative.ngram_mod.n_maximum"):
        check_build(EngineConfig("speculative", smol, "ngram-mod", k=4))
    with pytest.raises(LlamaCppError, match="unknown llama.cpp method 'medusa'"):
        parse_method("medusa:k=2", EngineConfig("speculative", smol))


def test_reconfigure_restarts_the_speculative_engine(managed):
    """A K sweep's restart keeps the method, draft and options; a method that does not start leaves the old engine
    running; drafting() reports what runs, in the form reconfigure() takes."""
    from dataclasses import replace

    from engine.drafting import Drafting

    old, before = managed.urls["speculative"], managed.drafting()
    managed.reconfigure(replace(before, k=2))
    try:
        assert managed.configs["speculative"].k == 2 and managed.urls["speculative"] != old
        assert managed.drafting() == replace(before, k=2)
        _, r = run(managed.speculative(Request(prompt=PROMPTS[0], max_new_tokens=16)))
        assert r.error is None and max(s.drafted for s in r.steps) == 2
        with pytest.raises(LlamaCppError, match="unknown llama.cpp method 'medusa'"):
            managed.reconfigure(Drafting("medusa", 2))
        with pytest.raises(LlamaCppError, match="unknown llama.cpp drafting settings: size"):
            managed.reconfigure(Drafting("ngram-simple", 2, options=(("size", 3),)))
    finally:
        managed.reconfigure(before)
    assert managed.drafting() == before


def test_launch_demo_on_the_llamacpp_backend(capsys):
    import launch

    code = launch.main(["demo", "--backend", "llamacpp", "--preset", "smollm2-ngram", "--llamacpp-method",
                        "ngram-simple", "--llamacpp-ngram-n", "2", "--llamacpp-threads", "1", "--temperature", "0",
                        "--max-new-tokens", "16", "--prompt", PROMPTS[0]])
    out = capsys.readouterr().out
    assert code == 0 and ("greedy outputs identical" in out or "outputs diverge at token" in out)
    assert "highlighting: exact" in out


def test_launch_refuses_a_draft_method_without_a_draft_model():
    import launch

    with pytest.raises(SystemExit, match="needs a draft GGUF"):
        launch.main(["demo", "--backend", "llamacpp", "--preset", "smollm2-ngram", "--llamacpp-method", "draft",
                     "--prompt", "x"])


# On this prompt the default pair's greedy outputs part at token 25 (one thread each, this build): llama.cpp's
# batched verification and its single-token decoding do not compute the same numbers
DIVERGING = "Tell a very short story about a robot who learns to bake bread."


def test_default_pair_end_to_end_shows_a_divergence(tmp_path):
    """The default preset's own GGUF pair (Qwen2.5-Coder 1.5B target, 0.5B draft), greedy."""
    from specconsole.render import figures_html

    target, draft = (str(gguf_model(name)[0]) for name in ("qwen2.5-coder-1.5b-instruct",
                                                           "qwen2.5-coder-0.5b-instruct"))
    backend = LlamaCppBackend.managed(EngineConfig("speculative", target, "draft", draft=draft, k=4, threads=1),
                                      log_dir=tmp_path)
    try:
        req = Request(prompt=DIVERGING, max_new_tokens=32)
        _, base = run(backend.baseline(req))
        _, spec = run(backend.speculative(req))
        assert base.error is None and spec.error is None
        assert spec.metrics.highlighting.startswith("exact") and spec.metrics.server["drafted"] > 0
        assert backend.describe() == {"backend": "llamacpp", "target_model": Path(target).name,
                                      "draft_model": Path(draft).name, "method": "llamacpp-draft",
                                      "label": "llamacpp-draft"}
        c = compare(base, spec, greedy=True)
        b, s = base.output_ids, spec.output_ids
        assert not c.identical and b[:c.first_divergence] == s[:c.first_divergence]
        assert b[c.first_divergence] != s[c.first_divergence]
        html = figures_html(base, spec, c, "fair", None)
        assert f"first divergence at token {c.first_divergence}" in html and "batched pass" in html
        print(f"default pair: speculative/baseline tok/s {c.speedup:.2f}, acceptance "
              f"{spec.metrics.acceptance_rate:.2f}, first divergence {c.first_divergence}")
    finally:
        backend.close()


def test_k_sweep_suite_restarts_the_engine_per_value_and_advises(managed, tmp_path):
    """A Workbench K sweep on llama.cpp: each K is the speculative engine's own (restarted with it), the suite's
    figures and advice come out as on the other backends, and the engine runs the user's K again afterwards."""
    from engine.request import build_request
    from specconsole.history import History
    from specconsole.suite_job import SuiteJob, export_suite
    from specconsole.suites import SuitePrompt

    history = History(tmp_path / "h.db")
    items = [SuitePrompt("code", p) for p in PROMPTS]
    job = SuiteJob(managed, history, items, build_request("", max_new_tokens=16), variable="k", values=["2", "3"])
    job.check()
    job.run()
    assert managed.configs["speculative"].k == 4 and managed.configs["speculative"].method == "draft"
    out = export_suite(history, managed, job.suite_id, tmp_path / "suite.csv", tmp_path / "r.html")
    agg = out.aggregates.set_index("sweep_value")
    # a step drafts at most K tokens: the per-position acceptance is K wide where some step drafted K
    assert [len(agg.loc[k, "per_position"]) for k in ("2", "3")] == [2, 3]
    for k in ("2", "3"):
        runs = history.runs(suite_id=job.suite_id)
        same = sum(bool(r["identical"]) for r in runs if r["sweep_value"] == k)
        assert agg.loc[k, "identical"] == f"{same}/3" and agg.loc[k, "prompts"] == 3
    [advice] = out.advice
    base = agg.loc["2"]
    expected = ("enable" if base["speedup_low"] >= 1.05 else "don't" if base["speedup_high"] < 1.0 else "undecided")
    assert advice.verdict.startswith(expected)
    all_lose = (agg["speedup_high"] < 1.0).all()
    assert (advice.least_loss == {"k": agg["speedup"].idxmax()}) if all_lose and expected == "don't" \
        else advice.least_loss == {}
    assert any(r.startswith("greedy output identical to the baseline's in") for r in advice.reasons)
    assert {"first_divergence", "divergence_note"} <= set(pd.read_csv(out.paths[0]))


def test_method_sweep_runs_llamacpp_methods_and_restores_the_draft(managed, tmp_path):
    from engine.request import build_request
    from specconsole.history import History
    from specconsole.suite_job import SuiteJob
    from specconsole.suites import SuitePrompt
    from specconsole.workbench import default_values

    assert default_values(managed, "k") == ["1", "2", "4", "8"]  # no dynamic K: llama.cpp drafts a fixed n_max
    assert default_values(managed, "method") == ["draft", "ngram-simple", "ngram-map-k", "ngram-mod"]
    with pytest.raises(ValueError, match="dynamic"):
        SuiteJob(managed, None, [SuitePrompt("code", "x")], build_request(""), variable="k",
                 values=["2", "dynamic"]).check()
    history = History(tmp_path / "h.db")
    job = SuiteJob(managed, history, [SuitePrompt("code", PROMPTS[0])], build_request("", max_new_tokens=12),
                   variable="method", values=["ngram-mod", "draft"])
    job.check()
    job.run()
    methods = {r["sweep_value"]: r["method"] for r in history.runs(suite_id=job.suite_id)}
    assert methods == {"ngram-mod": "llamacpp-ngram-mod", "draft": "llamacpp-draft"}
    assert managed.configs["speculative"].draft and managed.describe()["method"] == "llamacpp-draft"
