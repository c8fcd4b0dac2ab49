"""A server's spec-decode counters (engine.serving.counters): /metrics pages of both servers parsed to one shape, the
server's count of a run beside the run's own (a disagreement flagged, an expected difference said), and the scrape
of a page that is not there or cannot be read, which leaves the counters unknown and never fails a run. The real
servers' counters are read in tests/test_llamacpp_native.py and tests/test_vllm_real.py; here a small server on
127.0.0.1 serves canned pages."""

from __future__ import annotations

import http.server
import logging
import threading

import pytest

from engine.llamacpp.backend import LlamaCppBackend
from engine.serving.counters import counters_delta, parse_counters, server_counters

VLLM_PAGE = """# HELP x
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 5.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 20.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
"""
# as llama-server b11434 prints it (server-task.cpp): no labels but the position, C++ doubles for the three counters
LLAMACPP_PAGE = """# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 20
llamacpp:spec_decode_num_accepted_tokens_total 12
llamacpp:spec_decode_num_drafts_total 5
llamacpp:n_decode_total 77
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 5
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4
"""
PAGES = {"vllm:spec_decode_": VLLM_PAGE, "llamacpp:spec_decode_": LLAMACPP_PAGE}


@pytest.mark.parametrize("prefix", list(PAGES))
def test_both_servers_pages_parse_to_one_shape(prefix):
    page = PAGES[prefix]
    after = parse_counters(page, prefix)
    assert after == {"num_drafts": 5, "num_draft_tokens": 20, "num_accepted_tokens": 12, "per_pos": {0: 5, 1: 4},
                     "rounding": 0.0}
    other = next(p for p in PAGES if p != prefix)
    assert parse_counters(page, other) is None  # the other server's counters are not these
    before = parse_counters(page.replace(" 5", " 2").replace(" 20", " 8"), prefix)
    d = counters_delta(before, after)
    assert d["num_drafts"] == 3 and d["num_draft_tokens"] == 12 and d["num_accepted_tokens"] == 0
    assert d["per_pos"] == {0: 3, 1: 0}
    assert counters_delta(after, before) is None  # went down: the server restarted
    assert counters_delta(None, after) is None


@pytest.mark.parametrize("page, why", [
    ("llamacpp:spec_decode_num_drafts_total 5\nllamacpp:spec_decode_num_draft_tokens_total 20\n", "has no"),
    (LLAMACPP_PAGE.replace(" 12", " twelve"), "not a number"),
    (LLAMACPP_PAGE.replace(" 12", " -12"), "not a number"),
    (LLAMACPP_PAGE.replace('{position="1"}', '{pos="1"}'), "without a draft position"),
])
def test_a_page_whose_counters_cannot_be_read_is_unknown(caplog, page, why):
    assert parse_counters(page, "llamacpp:spec_decode_") is None
    assert why in caplog.text


def test_llama_servers_rounding_of_large_counters_is_known():
    """llama-server prints its counters as C++ doubles, 6 significant digits: past a million a reading is rounded."""
    page = LLAMACPP_PAGE.replace(" 20\n", " 1.23457e+06\n").replace(" 12\n", " 1e+06\n")
    reading = parse_counters(page, "llamacpp:spec_decode_")
    assert reading["num_draft_tokens"] == 1234570 and reading["rounding"] == 5.0
    later = parse_counters(page.replace(" 1e+06", " 1.00003e+06").replace("1.23457e+06", "1.23461e+06"),
                           "llamacpp:spec_decode_")
    d = counters_delta(reading, later)
    assert (d["num_draft_tokens"], d["num_accepted_tokens"], d["rounding"]) == (40, 30, 10.0)
    # the run counted 36 and 27: within the rounding of both readings, said, not flagged
    c = server_counters(reading, later, 36, 27)
    assert c.mismatch is None and "rounding" in c.expected_difference
    assert server_counters(reading, later, 20, 27).mismatch  # 20 off: beyond it


def reading(drafts: float, draft_tokens: float, accepted: float, per_pos=()) -> dict:
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "per_pos": dict(enumerate(per_pos)), "rounding": 0.0}


ZERO = reading(0, 0, 0)


def test_the_servers_count_beside_the_runs():
    c = server_counters(ZERO, reading(10, 40, 31, (10, 9, 7, 5)), 40, 31)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (10, 40, 31)
    assert c.per_position_acceptance == [1.0, 0.9, 0.7, 0.5]
    assert c.mismatch is None and c.expected_difference is None  # they agree: nothing to say
    # a planted disagreement, on a server that served nothing else: flagged, and the sentence says what differs
    c = server_counters(ZERO, reading(10, 40, 31), 36, 30)
    assert c.mismatch == "the server counted 40 drafted and 31 accepted tokens, this run 36 and 30"
    assert c.expected_difference is None
    assert server_counters(ZERO, reading(10, 40, 31), None, None).mismatch is None  # the run's counts unknown
    assert server_counters(None, reading(10, 40, 31), 40, 31) is None  # a reading unknown


def test_a_stop_inside_the_last_step_is_an_expected_difference():
    """The server counts every draft its last pass accepted; the run ends at the stop, `cut` drafts before them."""
    c = server_counters(ZERO, reading(10, 40, 33), 40, 31, cut=2)
    assert c.mismatch is None
    assert c.expected_difference == ("the server counted 40 drafted and 33 accepted tokens, this run 40 and 31: a "
                                     "stop ended the output inside the last step, and the server also counts the 2 "
                                     "drafts it accepted past the stop")
    assert server_counters(ZERO, reading(10, 40, 31), 40, 31, cut=2).mismatch  # the cut drafts are not counted
    assert server_counters(ZERO, reading(10, 40, 34), 40, 31, cut=2).mismatch  # one more than the cut


def test_a_shared_server_may_count_more_never_less():
    shared = server_counters(ZERO, reading(20, 80, 50), 40, 31, shared=True)
    assert shared.mismatch is None and "may have served other requests" in shared.expected_difference
    assert server_counters(ZERO, reading(20, 80, 50), 40, 31).mismatch  # managed: it served only the run
    assert server_counters(ZERO, reading(9, 36, 30), 40, 31, shared=True).mismatch  # fewer: no other request
    # more accepted than the extra drafts allow: another request cannot explain it
    assert server_counters(ZERO, reading(11, 42, 36), 40, 31, shared=True).mismatch


def test_a_stopped_run_differs_for_a_known_reason():
    """llama-server counts a dropped request when it notices the drop: right after a cancel, not at all."""
    c = server_counters(ZERO, ZERO, 8, 8, stopped=True)
    assert c.mismatch is None and "the run was stopped" in c.expected_difference
    assert server_counters(ZERO, reading(3, 12, 12), 12, 12, stopped=True).expected_difference is None


# --- the scrape: a page that is not there or cannot be read ----------------------------------------------------------


class MetricsServer(http.server.ThreadingHTTPServer):
    """127.0.0.1: /metrics answers `status` with `page`; every request's path and Authorization are kept."""

    def __init__(self, status: int, page: str):
        outer = self
        self.status, self.page, self.seen = status, page, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.seen.append((self.path, self.headers.get("Authorization")))
                body = outer.page.encode()
                self.send_response(outer.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def metrics_server():
    servers = []

    def make(status: int, page: str) -> MetricsServer:
        servers.append(MetricsServer(status, page))
        return servers[-1]

    yield make
    for server in servers:
        server.shutdown()
        server.server_close()


def backend(url: str) -> LlamaCppBackend:
    return LlamaCppBackend({"baseline": url, "speculative": url}, {}, api_key="k3y")


def test_the_scrape_reads_the_page_with_the_backends_key(metrics_server):
    server = metrics_server(200, LLAMACPP_PAGE)
    assert backend(server.url).scrape("speculative")["num_draft_tokens"] == 20
    assert server.seen == [("/metrics", "Bearer k3y")]


@pytest.mark.parametrize("status, page", [(501, '{"error":{"code":501,"message":"Start it with `--metrics`"}}'),
                                          (404, "not found"), (200, "llamacpp:n_decode_total 3\n")])
def test_a_server_without_counters_is_said_once_and_not_asked_again(metrics_server, caplog, status, page):
    server = metrics_server(status, page)
    b = backend(server.url)
    with caplog.at_level(logging.WARNING):
        assert b.scrape("speculative") is None and b.scrape("speculative") is None
    said = [r for r in caplog.records if "/metrics" in r.getMessage()]
    assert len(said) == 1 and "unknown" in said[0].getMessage() and "--metrics" in said[0].getMessage()
    assert len(server.seen) == 1


def test_a_page_that_cannot_be_read_is_unknown_for_that_run_only(metrics_server, caplog):
    server = metrics_server(500, "boom")
    b = backend(server.url)
    assert b.scrape("speculative") is None
    server.status, server.page = 200, LLAMACPP_PAGE  # it recovers: the next run reads it
    assert b.scrape("speculative")["num_drafts"] == 5
    assert "answered 500" in caplog.text


def test_a_server_that_is_gone_leaves_the_counters_unknown_without_an_error(metrics_server, caplog):
    server = metrics_server(200, LLAMACPP_PAGE)
    url = server.url
    server.shutdown()
    server.server_close()
    assert backend(url).scrape("speculative") is None
    assert "could not be read (ConnectError" in caplog.text
