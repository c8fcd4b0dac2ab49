"""The vLLM backend against servers that misbehave: a real HTTP server on a free port speaks the OpenAI streaming
protocol (the /v1/models and /metrics that attach() probes, and streamed chat completions), and the real
VLLMBackend.attach and httpx client talk to it. Nothing is mocked but the model.

Every faulty stream must end the run with a clear RunResult.error, keep the tokens streamed before the fault, never
hang and never raise out of the generator; per-step counts that contradict the streamed tokens leave them unplaced
(pending, figures unknown) without an error."""

from __future__ import annotations

import csv
import json
import logging
import math
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.events import Reclassified, RunResult, TokenEvent, TokenKind
from engine.request import Request
from engine.vllm.backend import VLLMBackend
from engine.vllm.config import speculative_config
from engine.vllm.server import VLLMError
from specconsole.render import PanelFeed
from specconsole.runner import LiveRun
from tests.conftest import free_ports

STALL_S = 3.0  # the backend's stall timeout in these tests: a hang shows up as an error within it
PROMPT_IDS = [1, 2, 3, 4]
WORDS = ["alpha", " beta", " gamma", " delta", " eps", " zeta"]


def sse(data) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def token_chunk(i: int) -> dict:
    return {"id": "c", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": WORDS[i]}, "finish_reason": None, "token_ids": [100 + i],
                         "logprobs": {"content": [{"token": WORDS[i], "logprob": -0.1}]}}]}


def stream(n_tokens: int = len(WORDS), spec: dict | None = None) -> list[bytes]:
    """A well-formed vLLM chat stream of `n_tokens`, ending with the usage chunk (with `spec` as the per-request
    speculative counts) and [DONE]."""
    first = {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": [],
                                     "finish_reason": None}], "prompt_token_ids": PROMPT_IDS}
    last = {"id": "c", "choices": [{"index": 0, "delta": {"content": ""}, "token_ids": [], "finish_reason": "length",
                                    "stop_reason": None}]}
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n_tokens},
             "metrics": {"time_to_first_token_ms": 3.0} | ({"speculative_decoding": spec} if spec else {})}
    return ([sse(first)] + [sse(token_chunk(i)) for i in range(n_tokens)] + [sse(last), sse(usage), sse("[DONE]")])


def spec_counts(accepted: list, drafted: list) -> dict:
    steps, d, a = len(drafted), sum(drafted), sum(accepted)
    return {"num_spec_steps": steps, "num_draft_tokens": d, "num_accepted_draft_tokens": a,
            "draft_acceptance_rate": a / d if d else 0.0, "mean_acceptance_length": 1 + a / steps if steps else 0.0,
            "per_step_accepted": accepted, "per_step_drafted": drafted}


class FakeVLLM(ThreadingHTTPServer):
    """One server; `body` is what the next completion streams, `close_after` makes it stop there (a crash)."""

    daemon_threads = True

    def __init__(self, speculative: bool):
        super().__init__(("127.0.0.1", 0), Handler)
        self.speculative = speculative
        self.body: list[bytes] = stream()
        self.chunked = False  # HTTP/1.1 chunked transfer encoding (as uvicorn sends) instead of close-delimited
        self.hang = False  # after the body, keep the connection open and send nothing
        self.release = threading.Event()  # ends a hang when the test is over
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.completions = 0  # completion requests served: which server an engine's run went to
        self.status = 200  # what a POST answers; with an error status, `body` is the error's body
        self.metrics_page: str | None = None  # /metrics, instead of the usual counters
        self.counters = [7.0, 21.0, 9.0]  # its spec-decode counters: drafts, draft tokens, accepted tokens
        self.grow = (0, 0, 0)  # what each completion adds to them
        self.seen: list[tuple[str, str | None]] = []  # (path, Authorization header) of every request

    def handle_error(self, request, client_address):
        pass  # a client that hangs up on a bad stream breaks the pipe: expected here


class Handler(BaseHTTPRequestHandler):
    server: FakeVLLM

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        if self.path.startswith("/v1/models"):
            self._send(json.dumps({"data": [{"id": "fake", "root": "fake/model", "max_model_len": 2048}]}))
        elif self.path.startswith("/metrics"):
            # vllm:spec_decode_* counters only on a speculative server (attach() tells the two apart by them)
            page = ("".join(f'vllm:spec_decode_{name}_total{{engine="0",model_name="fake"}} {value}\n'
                            for name, value in zip(("num_drafts", "num_draft_tokens", "num_accepted_tokens"),
                                                   self.server.counters))
                    if self.server.speculative else "vllm:num_requests_running 0.0\n")
            self._send(page if self.server.metrics_page is None else self.server.metrics_page, "text/plain")
        else:
            self.send_error(404)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        server = self.server
        server.seen.append((self.path, self.headers.get("Authorization")))
        server.completions += 1
        server.counters = [c + g for c, g in zip(server.counters, server.grow)]
        if server.chunked:
            self.protocol_version = "HTTP/1.1"
        self.send_response(server.status)
        self.send_header("Content-Type", "text/event-stream")
        if server.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for part in server.body:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part) if server.chunked else part)
            self.wfile.flush()
        if server.hang:
            server.release.wait(30)
        # no terminating zero-length chunk: a chunked body that stops here is cut off
        self.close_connection = True

    def _send(self, text: str, kind: str = "application/json"):
        body = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve(*fakes: FakeVLLM):
    """Serve the fake servers in the background until the test ends (a generator: yield from it in a fixture)."""
    for s in fakes:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield list(fakes)
    for s in fakes:
        s.release.set()
        s.shutdown()
        s.server_close()


@pytest.fixture
def servers():
    yield from serve(FakeVLLM(speculative=False), FakeVLLM(speculative=True))


@pytest.fixture
def four_servers():
    """A baseline and three speculative servers: the main one and two extras (an N-way comparison)."""
    yield from serve(FakeVLLM(speculative=False), *[FakeVLLM(speculative=True) for _ in range(3)])


def attach(servers, speculative: dict | None = None) -> VLLMBackend:
    backend = VLLMBackend.attach(servers[0].url, servers[1].url, speculative=speculative)
    backend.stall_timeout = STALL_S
    return backend


def run(backend: VLLMBackend, engine: str = "speculative") -> tuple[list, RunResult, float]:
    """All events of one run (the generator must not raise), the result, and how long it took."""
    t0 = time.monotonic()
    events = list(getattr(backend, engine)(Request(prompt="x", max_new_tokens=len(WORDS))))
    assert isinstance(events[-1], RunResult) and not any(isinstance(e, RunResult) for e in events[:-1])
    return events, events[-1], time.monotonic() - t0


# --- the fake server speaks the protocol: a good run is classified -----------------------------------------------


def test_a_well_formed_stream_is_classified_by_an_event(servers):
    """Control for the faults below: 6 tokens, steps (0,0) + (3,3) + (2,1) place them exactly."""
    servers[1].body = stream(spec=spec_counts([3, 1], [3, 2]))
    events, result, _ = run(attach(servers))
    assert result.error is None and result.finish_reason == "length"
    assert result.metrics.highlighting == "exact"
    streamed = [e for e in events if isinstance(e, TokenEvent)]
    assert [t.kind for t in streamed] == [TokenKind.PENDING] * 6  # never changed after they were yielded
    assert isinstance(events[-2], Reclassified)
    expected = [TokenKind.BASELINE, TokenKind.ACCEPTED, TokenKind.ACCEPTED, TokenKind.ACCEPTED, TokenKind.BONUS,
                TokenKind.ACCEPTED]
    assert [t.kind for t in result.tokens] == expected
    assert result.output_text == "".join(WORDS)

    # the console's copy and the page: the panel is re-sent once, from the start, with the final kinds
    live, feed = LiveRun("speculative"), PanelFeed("run")
    messages = []
    for event in events[:-1]:
        live.apply(event)
        messages.append(feed.message(live.result.tokens))
    assert [t.kind for t in live.result.tokens] == expected
    resets = [json.loads(m) for m in messages if m and json.loads(m)["reset"]]
    assert len(resets) == 1 and resets[0]["start"] == 0 and "bonus" in "".join(resets[0]["tokens"])


def test_the_servers_counters_stand_beside_the_runs_count(servers):
    """/metrics read before and after the run: the server's count agrees with the placed steps, counts the drafts
    a stop cut off (said, not flagged), or disagrees (flagged)."""
    backend = attach(servers)
    servers[1].body, servers[1].grow = stream(spec=spec_counts([3, 1], [3, 2])), (2, 5, 4)
    c = run(backend)[1].metrics.server_counters
    assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (2, 5, 4)
    assert c.mismatch is None and c.expected_difference is None
    # the second step kept both drafts, but the token limit ends the output after the first of them
    servers[1].body, servers[1].grow = stream(spec=spec_counts([3, 2], [3, 2])), (2, 5, 5)
    result = run(backend)[1]
    c = result.metrics.server_counters
    assert result.metrics.highlighting == "exact" and result.metrics.accepted == 4
    assert c.mismatch is None and "the server also counts the 1 draft it accepted past the stop" in \
        c.expected_difference
    servers[1].body, servers[1].grow = stream(spec=spec_counts([3, 1], [3, 2])), (2, 5, 3)
    c = run(backend)[1].metrics.server_counters
    assert c.mismatch == "the server counted 5 drafted and 3 accepted tokens, this run 5 and 4"


# --- (a) malformed and truncated streams ---------------------------------------------------------------------------


BAD_CHUNKS = {
    "not JSON": "data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"x\"",
    "JSON but not an object": "data: 42",
    "no choices": 'data: {"id": "c", "object": "chat.completion.chunk"}',
    "text without token ids": 'data: {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": null}]}',
    "token ids that are not integers": 'data: {"choices": [{"index": 0, "delta": {"content": "x"}, '
                                       '"token_ids": ["x"]}]}',
    "an error report": 'data: {"error": {"message": "CUDA out of memory", "type": "InternalServerError"}}',
}


@pytest.mark.parametrize("engine", ["baseline", "speculative"])
@pytest.mark.parametrize("bad", list(BAD_CHUNKS))
def test_a_malformed_chunk_ends_the_run_with_an_error(servers, bad, engine):
    server = servers[0 if engine == "baseline" else 1]
    good = stream()
    server.body = good[:4] + [(BAD_CHUNKS[bad] + "\n\n").encode()] + good[4:]  # after 3 tokens
    events, result, took = run(attach(servers), engine)
    assert result.finish_reason == "error" and f"the {engine} vLLM server failed: StreamError" in result.error
    assert ("error mid-answer: CUDA out of memory" if bad == "an error report" else "stream chunk") in result.error
    assert [t.token_id for t in result.tokens] == [100, 101, 102]  # the tokens it had
    assert result.output_text == "".join(WORDS[:3])
    assert not any(isinstance(e, Reclassified) for e in events) and took < STALL_S


@pytest.mark.parametrize("chunked", [False, True], ids=["connection-closed", "chunked-body-cut"])
def test_a_stream_cut_off_mid_chunk_ends_with_an_error(servers, chunked):
    good = stream()
    servers[1].body = good[:4] + [good[4][:25]]  # half of the 4th token's line, then the connection closes
    servers[1].chunked = chunked
    _, result, took = run(attach(servers))
    assert result.finish_reason == "error" and result.error.startswith("the speculative vLLM server failed")
    assert [t.token_id for t in result.tokens] == [100, 101, 102] and took < STALL_S
    # close-delimited: the partial line is read and cannot be parsed; chunked: httpx sees the body cut short
    assert ("stream chunk is not JSON" if not chunked else "RemoteProtocolError") in result.error


@pytest.mark.parametrize("chunked", [False, True], ids=["connection-closed", "chunked-body-cut"])
def test_a_stream_without_done_ends_with_an_error(servers, chunked):
    """Whole chunks, the finish reason even, and then the connection closes without `data: [DONE]`."""
    servers[0].body = stream()[:-2]  # no usage chunk, no [DONE]
    servers[0].chunked = chunked
    _, result, took = run(attach(servers), "baseline")
    assert result.finish_reason == "error" and took < STALL_S
    assert ("before its last line (data: [DONE])" if not chunked else "RemoteProtocolError") in result.error
    assert [t.token_id for t in result.tokens] == list(range(100, 106))


def test_a_server_that_stops_sending_is_reported_not_waited_for(servers):
    servers[1].body, servers[1].hang = stream()[:3], True  # two tokens, then silence with the connection open
    _, result, took = run(attach(servers))
    assert result.finish_reason == "error" and "stopped answering: ReadTimeout" in result.error
    assert len(result.tokens) == 2 and STALL_S <= took < STALL_S + 5


# --- (b) per-step counts that contradict the streamed tokens -------------------------------------------------------


CONTRADICTIONS = {
    "too many tokens counted": ([3, 3, 3], [3, 3, 3], None),  # 1 + 4 + 4 + 4 = 13 for 6, two steps too many
    "too few tokens counted": ([0], [3], None),  # 1 + 1 = 2 for 6, and no n-gram replay to place the rest
    "n-gram replay disagrees": ([0], [3], speculative_config("ngram", 3)),  # the replay drafts nothing here
    "arrays of different lengths": ([3, 1], [3], None),
    "more accepted than drafted": ([3, 4], [3, 2], None),
    "counts that are not numbers": (["3", None], [3, 2], None),
}


@pytest.mark.parametrize("case", list(CONTRADICTIONS))
def test_counts_that_do_not_add_up_leave_the_tokens_unplaced(servers, case):
    accepted, drafted, config = CONTRADICTIONS[case]
    servers[1].body = stream(spec=spec_counts([a if isinstance(a, int) else 0 for a in accepted], drafted)
                             | {"per_step_accepted": accepted})
    events, result, _ = run(attach(servers, config))
    assert result.error is None and result.finish_reason == "length"
    assert not any(isinstance(e, Reclassified) for e in events)
    m = result.metrics
    assert result.steps == [] and m.provisional_accuracy is None and "tokens unplaced" in m.highlighting
    if config is None:  # K not known: nothing to guess with
        assert [t.kind for t in result.tokens] == [TokenKind.PENDING] * 6
        assert "tokens stay pending" in m.highlighting
    else:  # the guesses from chunk boundaries stay, marked provisional
        assert all(t.provisional for t in result.tokens) and TokenKind.PENDING not in {t.kind for t in result.tokens}
        assert "tokens keep their provisional kinds" in m.highlighting
    assert m.target_passes is None and m.passes_saved is None and m.mean_k is None
    assert m.steps == len(drafted) and m.drafted == sum(drafted)  # the server's own counts are still shown
    assert m.server_counters.drafts == 0.0  # /metrics was read before and after
    assert m.server_counters.mismatch.startswith("the server counted 0 drafted and 0 accepted tokens, this run")


def test_a_usage_chunk_without_counts_says_unknown(servers):
    servers[1].body = stream(spec={"num_spec_steps": 2})  # counts, but no per-step arrays
    events, result, _ = run(attach(servers))
    assert result.error is None and not any(isinstance(e, Reclassified) for e in events)
    assert result.metrics.target_passes is None and "tokens stay pending" in result.metrics.highlighting


# --- provisional kinds from chunk boundaries -------------------------------------------------------------------


def chunked_stream(sizes: list[int], spec: dict, prompt_ids: list[int] | None = None) -> list[bytes]:
    """stream(), with the tokens grouped into chunks of these sizes (as a server sends one chunk per step)."""
    parts = stream(sum(sizes), spec=spec)
    if prompt_ids:
        parts[0] = sse(json.loads(parts[0][6:]) | {"prompt_token_ids": prompt_ids})
    first, tokens, tail = parts[0], [json.loads(p[6:]) for p in parts[1:1 + sum(sizes)]], parts[1 + sum(sizes):]
    chunks, i = [], 0
    for size in sizes:
        group = tokens[i:i + size]
        choice = group[0]["choices"][0] | {
            "delta": {"content": "".join(c["choices"][0]["delta"]["content"] for c in group)},
            "token_ids": [t for c in group for t in c["choices"][0]["token_ids"]],
            "logprobs": {"content": [p for c in group for p in c["choices"][0]["logprobs"]["content"]]}}
        chunks.append(sse({"id": "c", "object": "chat.completion.chunk", "choices": [choice]}))
        i += size
    return [first] + chunks + tail


# a draft model's K=3 (nothing to replay: the guess goes by K alone)
DRAFT_MODEL = speculative_config("draft_model", 3, "/draft")
A, B, R, BL = TokenKind.ACCEPTED, TokenKind.BONUS, TokenKind.RECOVERED, TokenKind.BASELINE

PROVISIONAL_CASES = {
    # chunk sizes, per-step (accepted, drafted), the guessed kinds, the final kinds, provisional accuracy
    # one chunk per step: every guess is right
    "chunks are steps": ([1, 4, 1], ([3, 0], [3, 2]), [BL, A, A, A, B, R], [BL, A, A, A, B, R], 1.0),
    # the prefill's token and the first step arrive together, and a step's tokens split over two chunks
    "chunk boundaries mislead": ([3, 2, 1], ([3, 1], [3, 2]), [BL, A, R, A, R, R], [BL, A, A, A, B, A], 3 / 6),
    # a chunk longer than K+1 holds two steps (a slow reader): split into steps of K+1
    "merged steps": ([1, 5], ([3, 0], [3, 3]), [BL, A, A, A, B, R], [BL, A, A, A, B, R], 1.0),
}


@pytest.mark.parametrize("case", list(PROVISIONAL_CASES))
def test_chunk_sizes_give_provisional_kinds_that_the_counts_confirm_or_correct(servers, case):
    sizes, (accepted, drafted), guessed, final, accuracy = PROVISIONAL_CASES[case]
    servers[1].body = chunked_stream(sizes, spec_counts(accepted, drafted))
    events, result, _ = run(attach(servers, DRAFT_MODEL))
    assert result.error is None and result.metrics.highlighting == "exact"

    streamed = [e for e in events if isinstance(e, TokenEvent)]
    assert [t.kind for t in streamed] == guessed and all(t.provisional for t in streamed)
    assert [t.kind for t in result.tokens] == final and not any(t.provisional for t in result.tokens)
    assert result.metrics.provisional_accuracy == pytest.approx(accuracy)

    # the console's copy: Reclassified gives the final kinds and clears the mark; the panel is re-sent from the
    # start once, even where every guess was right (the provisional mark goes)
    live, feed = LiveRun("speculative"), PanelFeed("run")
    messages = []
    for event in events[:-1]:
        live.apply(event)
        messages.append(feed.message(live.result.tokens))
    assert [t.kind for t in live.result.tokens] == final and not any(t.provisional for t in live.result.tokens)
    resets = [json.loads(m) for m in messages if m and json.loads(m)["reset"]]
    assert len(resets) == 1 and resets[0]["start"] == 0 and "provisional" not in "".join(resets[0]["tokens"])
    assert all("provisional" in span for m in messages[:-1] if m for span in json.loads(m)["tokens"])


def test_without_k_tokens_stream_pending_and_accuracy_is_unknown(servers):
    """Servers attached without their config: K is not known, so nothing is guessed."""
    servers[1].body = chunked_stream([1, 4, 1], spec_counts([3, 0], [3, 2]))
    events, result, _ = run(attach(servers))
    assert {e.kind for e in events if isinstance(e, TokenEvent)} == {TokenKind.PENDING}
    assert result.metrics.highlighting == "exact" and result.metrics.provisional_accuracy is None


def test_provisional_accuracy_is_saved_with_the_run_and_exported(servers, tmp_path):
    from specconsole.export import export_csv
    from specconsole.history import History
    from specconsole.runner import Comparison

    servers[1].body = chunked_stream([3, 2, 1], spec_counts([3, 1], [3, 2]))
    history = History(tmp_path / "h.db")
    comp = Comparison(attach(servers, DRAFT_MODEL), Request(prompt="x", max_new_tokens=6),
                      "fair", history, {"category": "t", "backend": "vllm"})
    comp.start()
    deadline = time.monotonic() + 60
    while not comp.poll(0.05):
        assert time.monotonic() < deadline
    assert comp.status == "completed", comp.error
    rebuilt = history.results(comp.run_id)["speculative"]
    assert rebuilt.metrics.provisional_accuracy == 0.5
    assert rebuilt.tokens[4].kind == TokenKind.BONUS and not any(t.provisional for t in rebuilt.tokens)
    summary, tokens = export_csv(history, tmp_path)
    with open(summary, newline="") as f:
        assert next(csv.DictReader(f))["speculative_provisional_accuracy"] == "0.5"
    assert "provisional" in tokens.read_text().splitlines()[0]


def test_an_ngram_replay_tells_plain_steps_and_short_drafts():
    """For n-gram drafting the guess asks a replay of the proposer how many drafts each step had: a lone token after
    no drafts is a plain step (baseline), not a rejection, and a step after fewer than K drafts can be a bonus."""
    from engine.vllm.steps import ChunkGuess, ngram_drafts

    config = speculative_config("ngram", 3)
    guess = ChunkGuess(3, ngram_drafts([5, 6, 7, 8, 9], config, 2048))
    # prefill; [6, 7, 8] drafted after "5" and kept, 9 the bonus; [5, 6, 7] drafted after "9", 1 the recovered
    # token; nothing drafted after "1": 2 is a plain step
    assert [guess.kinds(ids) for ids in ([5], [6, 7, 8, 9], [1], [2])] == [
        [(BL, 0, 0)], [(A, 1, 0), (A, 1, 1), (A, 1, 2), (B, 1, 3)], [(R, 2, 0)], [(BL, 3, 0)]]
    merged = ChunkGuess(3, ngram_drafts([5, 6, 7, 8, 9], config, 2048))  # two steps in one chunk: split
    assert [kind for kind, _, _ in merged.kinds([5]) + merged.kinds([6, 7, 8, 9, 1])] == [BL, A, A, A, B, R]
    short = ChunkGuess(3, ngram_drafts([7, 5, 6], config, 2048))  # only [6, 5] follows "5": two drafts
    assert [kind for kind, _, _ in short.kinds([5]) + short.kinds([6, 5, 4])] == [BL, A, A, B]


@pytest.mark.parametrize("sizes, guessed, final, accuracy", [
    # 4 tokens: the counts fit "prefill + the step, cut after 3 tokens"
    ([1, 1, 2], [BL, BL, A, R], [BL, BL, A, A], 0.75),
    # 5 tokens: the counts add up exactly ("prefill + the whole step"), the cut and the plain step cancel out
    ([1, 1, 3], [BL, BL, A, A, R], [BL, BL, A, A, A], 0.8),
])
def test_a_stop_that_cuts_the_last_step_does_not_hide_a_plain_step(servers, sizes, guessed, final, accuracy):
    """One step in the counts (3 drafted, 3 accepted), but the n-gram proposer had no drafts after the prefill's
    token (100 is not in the prompt): the truth is prefill, a plain step, then the step cut by a stop. The replay
    says so; the chunk guess saw it live, and the token it could not know (the cut step's last, guessed recovered)
    counts as wrong."""
    servers[1].body = chunked_stream(sizes, spec_counts([3], [3]), prompt_ids=[7, 101, 102, 103, 104])
    events, result, _ = run(attach(servers, speculative_config("ngram", 3)))
    assert [e.kind for e in events if isinstance(e, TokenEvent)] == guessed
    assert result.metrics.highlighting.startswith("exact (steps without drafts placed by replaying")
    assert [t.kind for t in result.tokens] == final and [t.step for t in result.tokens][:2] == [0, 1]
    assert result.metrics.provisional_accuracy == pytest.approx(accuracy)


# --- N-way: each extra speculative engine is a server of its own ----------------------------------------------------

def test_an_nway_comparison_streams_each_engine_from_its_own_server(four_servers, tmp_path):
    """Attached with two extra speculative servers, the backend offers them as variants named by their configs; a
    3-engine comparison that picks the second extra streams each engine from its own server (told apart by their
    answers' lengths and by the requests each server got), and the history stores the three engines."""
    from specconsole.history import History
    from specconsole.runner import Comparison
    from specconsole.variants import served

    base, main, extra_a, extra_b = four_servers
    main.body = stream(6, spec_counts([2, 1], [3, 2]))  # 1 prefill token + (2+1) + (1+1)
    extra_a.body = stream(4, spec_counts([2], [2]))
    extra_b.body = stream(3, spec_counts([1], [2]))
    backend = VLLMBackend.attach(base.url, main.url, speculative=speculative_config("draft_model", 3, "d"),
                                 extra=[(extra_a.url, speculative_config("draft_model", 2, "d")),
                                        (extra_b.url, speculative_config("draft_model", 4, "d"))])
    assert backend.capabilities.fixed_variants
    assert [v["label"] for v in backend.variants().values()] == ["vLLM draft_model K=2", "vLLM draft_model K=4"]
    from specconsole.run_layout import compare_choices
    assert compare_choices(backend)["choices"] == ["vLLM draft_model K=2", "vLLM draft_model K=4"]  # the page's
    req = Request(prompt="x", max_new_tokens=len(WORDS))
    extra = served(backend, req, ["vLLM draft_model K=4"])  # the second extra server only
    history = History(tmp_path / "h.db")
    comp = Comparison(backend, req, "fair", history, {"category": "t", "backend": "vllm", "method": "draft_model"},
                      extra=extra, label="vLLM draft_model K=3")
    comp.start()
    deadline = time.monotonic() + 60
    while not comp.poll(0.05):
        assert time.monotonic() < deadline
    assert comp.status == "completed", comp.error
    results = comp.results
    assert {e: len(r.output_ids) for e, r in results.items()} == {"baseline": 6, "speculative": 6, "speculative-2": 3}
    assert [base.completions, main.completions, extra_a.completions, extra_b.completions] == [1, 1, 0, 1]
    assert results["speculative-2"].metrics.accepted == 1 and results["speculative-2"].metrics.steps == 1
    assert results["speculative-2"].metrics.highlighting == "exact"
    saved = history.engines(comp.run_id)
    assert [(e, r["label"], r["method"]) for e, r in saved.items()] == [
        ("baseline", "baseline", "none"), ("speculative", "vLLM draft_model K=3", "draft_model"),
        ("speculative-2", "vLLM draft_model K=4", "draft_model")]
    assert list(history.results(comp.run_id)) == ["baseline", "speculative", "speculative-2"]


def test_demo_on_vllm_compares_every_attached_server(four_servers, capsys):
    """`launch.py demo --backend vllm` with extra attached servers streams each in turn and prints one table row per
    server, labelled by the config --vllm-compare gave it."""
    import launch

    base, main, extra_a, extra_b = four_servers
    extra_a.body, extra_b.body = stream(4), stream(3)
    urls = ",".join(s.url for s in four_servers)
    rc = launch.main(["demo", "--backend", "vllm", "--prompt", "x", "--max-new-tokens", "6", "--vllm-attach", urls,
                      "--vllm-compare", "ngram:k=2,ngram:k=5"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "== speculative-2 (vLLM ngram K=2) ==" in out and "== speculative-3 (vLLM ngram K=5) ==" in out
    table = out[out.index("engine "):].splitlines()
    assert [line.split()[0] for line in table[1:]] == ["baseline", "speculative", "speculative-2", "speculative-3"]
    assert [s.completions for s in four_servers] == [1, 1, 1, 1]


# --- a hostile server: bounded reading, figures that cannot be true, credentials in its URL ------------------------

HUGE = 10 * 1024 * 1024  # 10 MB: a line, an error body


def peak_bytes(fn):
    """fn()'s result and the most memory Python held meanwhile beyond what it held before (all threads)."""
    tracemalloc.start()
    try:
        return fn(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("engine", ["baseline", "speculative"])
def test_a_10mb_line_is_cut_off_with_an_error(servers, engine):
    server = servers[0 if engine == "baseline" else 1]
    good = stream()
    server.body = good[:4] + [b"data: {\"choices\": \"" + b"x" * HUGE + b"\"}\n\n"] + good[4:]
    (_, result, _), peak = peak_bytes(lambda: run(attach(servers), engine))
    assert result.finish_reason == "error" and "a streamed line is longer than" in result.error
    assert [t.token_id for t in result.tokens] == [100, 101, 102]
    assert peak < 2 * 1024 * 1024  # the line was never held whole


def test_endless_tokens_are_cut_off_past_max_new_tokens(servers):
    from engine.serving.stream import TOKEN_MARGIN

    def endless():  # 20000 tokens without a finish (bounded only so that a client that never stops ends)
        yield stream()[0]
        for i in range(20000):
            yield sse(token_chunk(i % len(WORDS)))

    servers[0].body = endless()
    _, result, _ = run(attach(servers), "baseline")
    assert result.finish_reason == "error" and "more tokens than asked for" in result.error
    assert len(WORDS) < len(result.tokens) <= len(WORDS) + TOKEN_MARGIN


def test_a_10mb_error_body_is_read_only_4kb(servers):
    servers[1].status, servers[1].body = 500, [b"boom " * (HUGE // 5)]
    (_, result, _), peak = peak_bytes(lambda: run(attach(servers)))
    assert result.finish_reason == "error" and "answered 500: boom boom" in result.error
    assert "cut at 4 KiB" in result.error and len(result.error) < 5000 and peak < 1024 * 1024
    # the requests that are not streamed (the sampling check's scoring) read no more of an error
    servers[0].status, servers[0].body = 500, [b"boom " * (HUGE // 5)]
    backend = attach(servers)
    with pytest.raises(VLLMError, match="answered 500: boom") as caught:
        peak_bytes(lambda: backend.score(Request(prompt="x"), [[1, 2]]))
    assert len(str(caught.value)) < 5000
    _, peak = peak_bytes(lambda: pytest.raises(VLLMError, backend.score, Request(prompt="x"), [[1, 2]]))
    assert peak < 1024 * 1024


@pytest.mark.parametrize("logprob", [1e6, float("nan"), "high", [1]], ids=["1e6", "NaN", "a word", "a list"])
def test_a_logprob_that_cannot_be_true_is_unknown(servers, caplog, logprob):
    bad = token_chunk(3)
    bad["choices"][0]["logprobs"]["content"][0]["logprob"] = logprob
    good = stream()
    servers[0].body = good[:4] + [sse(bad)] + good[5:]
    _, result, _ = run(attach(servers), "baseline")
    assert result.error is None and [t.token_id for t in result.tokens] == list(range(100, 106))
    assert result.tokens[3].p is None and result.tokens[2].p == pytest.approx(math.exp(-0.1))
    assert "a token's logprob" in caplog.text and "shown as unknown" in caplog.text


def test_server_figures_that_are_not_numbers_are_unknown(servers, caplog, tmp_path):
    """The per-request counts are read where the tokens cannot be placed (too many steps counted here): each one
    that is not a number, or not a possible one, is unknown; nothing of it reaches the history."""
    from specconsole.history import History
    from specconsole.runner import Comparison

    spec = spec_counts([3, 3, 3], [3, 3, 3]) | {
        "draft_acceptance_rate": "x", "num_accepted_draft_tokens": -5, "num_spec_steps": 1e300,
        "mean_acceptance_length": float("nan")}
    body = stream(spec=spec)
    usage = json.loads(body[-2][6:])
    usage["usage"]["completion_tokens"] = "six"
    usage["metrics"] |= {"time_to_first_token_ms": "fast", "mean_itl_ms": float("nan"), "tokens_per_second": -1.0}
    servers[1].body = body[:-2] + [sse(usage), sse("[DONE]")]
    _, result, _ = run(attach(servers))
    m = result.metrics
    assert result.error is None and "tokens unplaced" in m.highlighting
    for key in ("acceptance_rate", "steps", "accepted", "mean_accepted_length"):
        assert getattr(m, key) is None, key
    for key in ("completion_tokens", "time_to_first_token_ms", "mean_itl_ms", "tokens_per_second"):
        assert m.server[key] is None, key
    assert m.drafted == 9  # the one count that is possible is kept
    json.dumps(m.to_dict(), allow_nan=False)  # no NaN or infinity either
    assert "draft_acceptance_rate" in caplog.text and "shown as unknown" in caplog.text

    servers[1].body = body[:-2] + [sse(usage), sse("[DONE]")]
    history = History(tmp_path / "h.db")
    comp = Comparison(attach(servers), Request(prompt="x", max_new_tokens=6), "fair", history,
                      {"category": "t", "backend": "vllm"})
    comp.start()
    deadline = time.monotonic() + 60
    while not comp.poll(0.05):
        assert time.monotonic() < deadline
    assert comp.status == "completed", comp.error
    assert history.results(comp.run_id)["speculative"].metrics.acceptance_rate is None
    assert history.runs()[0]["acceptance_rate"] is None


METRICS_FAULTS = {
    "a word": 'vllm:spec_decode_num_drafts_total{engine="0"} x\n',
    "NaN": 'vllm:spec_decode_num_drafts_total{engine="0"} NaN\n',
    "negative": 'vllm:spec_decode_num_drafts_total{engine="0"} -3.0\n',
    "two exponents": 'vllm:spec_decode_num_drafts_total{engine="0"} 1e5e5\n',
    "no position": 'vllm:spec_decode_num_drafts_total{engine="0"} 7.0\n'
                   'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0"} 3.0\n',
}


@pytest.mark.parametrize("fault", list(METRICS_FAULTS))
def test_metrics_counters_that_are_not_numbers_are_unknown(servers, caplog, fault):
    servers[1].metrics_page = METRICS_FAULTS[fault]
    servers[1].body = stream(spec=spec_counts([3, 1], [3, 2]))
    _, result, _ = run(attach(servers))
    assert result.error is None and result.metrics.highlighting == "exact"  # the run itself is fine
    assert result.metrics.server_counters is None
    assert "/metrics" in caplog.text and "unknown" in caplog.text


def with_credentials(url: str) -> str:
    return url.replace("http://", "http://user:hunter2@") + "/?api_key=sesame"


def test_credentials_in_server_urls_are_never_shown(servers, caplog, capsys):
    import launch

    caplog.set_level(logging.INFO)
    secret = ("hunter2", "sesame")
    backend = VLLMBackend.attach(*(with_credentials(s.url) for s in servers))
    backend.stall_timeout = STALL_S
    _, result, _ = run(backend)
    # the query goes with every request, the user and password as HTTP basic auth (httpx's doing)
    assert result.error is None and ("/v1/chat/completions?api_key=sesame", "Basic dXNlcjpodW50ZXIy") in servers[1].seen
    assert not any(s in json.dumps(backend.describe()) for s in secret)  # saved with every run
    servers[0].status = 401  # the scoring fails: its message names the server
    with pytest.raises(VLLMError) as caught:
        backend.score(Request(prompt="x"), [[1]])
    assert "answered 401" in str(caught.value)

    # a server that cannot be reached: the error, the page's label and the log show where, not the credentials
    closed = with_credentials(f"http://127.0.0.1:{free_ports(1)[0]}")
    with pytest.raises(VLLMError, match=r"cannot reach a vLLM server at http://\*\*\*@127.0.0.1:\d+/\?api_key=\*\*\*"):
        VLLMBackend.attach(closed, closed)
    assert launch.main(["demo", "--backend", "vllm", "--prompt", "x", "--vllm-attach", f"{closed},{closed}"]) == 2
    shown = str(caught.value) + caplog.text + "".join(capsys.readouterr())
    assert "HTTP Request: GET http://***@127.0.0.1" in caplog.text and "vLLM servers at http://***@" in caplog.text
    assert not any(s in shown for s in secret)
