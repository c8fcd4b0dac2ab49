"""The engine process (engine.process): our engines in a process of their own, driven over one pipe, on tiny models
built from a config; a real SQLite file; real signals."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from functools import partial

import pytest

from engine.backend import Backend
from engine.events import StepRecord, TokenEvent
from engine.limits import SettingsError
from engine.exact import calibration
from engine.exact.models import ModelError
from engine.process.client import EngineProcess, EngineProcessError
from engine.request import build_request
from specconsole.history import History
from specconsole.runner import Comparison
from tests.conftest import run_to_end
from tests.engine_factories import dying_backend, failing_backend, threads_seen_backend, tiny_chat_backend

PROMPT = "Write a function that adds two numbers, then explain it line by line."


@pytest.fixture(scope="module")
def engines():
    process = EngineProcess(tiny_chat_backend).start()
    yield process
    process.close()


def request(max_new: int = 48, **kw):
    """The console's defaults (hybrid drafting, dynamic K, the draft's confidence stop), greedy."""
    return build_request(PROMPT, max_new_tokens=max_new, temperature=0.0, method=kw.pop("method", "hybrid"), **kw)


def test_the_engines_passes_run_in_the_engine_process(engines, tmp_path):
    """The console's process (this one, which would serve Gradio) holds no model: every pass of both engines ran in
    the engine process, and the history says which process that was."""
    assert isinstance(engines, Backend) and engines.capabilities.fair_strategy == "alternate"
    history = History(tmp_path / "h.db")
    comp = run_to_end(Comparison(engines, request(), "fair", history, engines.describe()))
    pids = {e: r.metrics.engine_pid for e, r in comp.results.items()}
    assert pids == {"baseline": engines.pid, "speculative": engines.pid} and engines.pid != os.getpid()
    assert history.results(comp.run_id)["baseline"].metrics.engine_pid == engines.pid  # saved with the run
    assert comp.comparison().identical


@pytest.mark.parametrize("mode", ["fair", "race"])
def test_one_thread_builds_the_models_and_computes_every_pass(mode):
    """torch's OpenMP keeps a pool of workers per thread that ran a parallel operation, and a second pool alive slows
    every pass (engine.process.child): the thread that built the models computes every event of both engines, in
    fair mode and with the engines at once (race mode)."""
    process = EngineProcess(threads_seen_backend).start()
    try:
        comp = run_to_end(Comparison(process, request(24), mode, None, {}))
        assert comp.comparison().identical
        seen = process.memory()["threads"]
    finally:
        process.close()
    assert {what for what, _ in seen} == {"build", "baseline", "speculative"}
    assert {thread for _, thread in seen} == {seen[0][1]}, seen


@pytest.mark.parametrize("method", ["hybrid", "ngram"])
def test_the_engine_process_gives_what_the_backend_gives_in_process(engines, backend, method, monkeypatch):
    """The same request through the engine process and through the same backend in this process: the same tokens,
    the same passes, the same drafting plan from the same costs (the policy reads its calibrated costs, not timings;
    n-gram drafts at dynamic K too, whose drafted tokens cost nothing). Tiny models are no preset's, so each backend
    measures its own costs: this one is given the engine process's, or a pass measured a millisecond apart would
    plan differently."""
    monkeypatch.setattr(backend, "costs", calibration.from_dict(engines.calibration()))
    req = request(max_new=64, method=method)
    there = run_to_end(Comparison(engines, req, "fair", None, {})).results
    here = run_to_end(Comparison(backend, req, "fair", None, {})).results
    assert not there["speculative"].error and there["speculative"].metrics.drafted > 0
    for e in ("baseline", "speculative"):
        assert there[e].output_ids == here[e].output_ids
        assert [(s.drafted, s.accepted) for s in there[e].steps] == [(s.drafted, s.accepted) for s in here[e].steps]


def test_a_plan_does_not_follow_the_machines_speed(engines):
    """Two runs of one request make one plan, whatever the passes took meanwhile: K per step and tokens per pass."""
    req = request(max_new=64)
    plans = [[(s.drafted, s.emitted) for s in run_to_end(Comparison(engines, req, "fair", None, {})).results[
        "speculative"].steps] for _ in range(2)]
    assert plans[0] == plans[1]


def test_bad_input_is_refused_by_the_engine_process_with_its_message(engines):
    with pytest.raises(SettingsError, match="the prompt is empty"):
        engines.validate(build_request("", max_new_tokens=8))
    comp = run_to_end(Comparison(engines, build_request(" ", max_new_tokens=8), "fair", None, {}))
    assert comp.status == "failed" and "the prompt is empty" in comp.error  # raised in the stream, said in the run
    assert engines.alive  # and the process serves on
    assert engines.calibration()["target_step_ms"] > 0


def until_tokens(comp: Comparison, engine: str, n: int):
    """Poll a started fair comparison until `engine` streamed `n` tokens; return holding its turn lock, so that no
    engine takes another turn until the caller releases it."""
    for _ in range(10_000):
        comp.poll(0.001)
        comp.ui_lock.__enter__()
        if len(comp.live[engine].result.tokens) >= n:
            return
        comp.ui_lock.__exit__()
    raise AssertionError("the run did not stream")


def test_stop_ends_the_run_within_one_pass(engines):
    comp = Comparison(engines, request(max_new=200, method="draft"), "fair", None, {})
    comp.start()
    until_tokens(comp, "baseline", 3)
    # the passes made so far: applied, or handed over and not yet applied
    queued = [e for e, event in list(comp.events.queue) if isinstance(event, StepRecord)]
    before = {e: len(comp.live[e].result.steps) + queued.count(e) for e in comp.engines}
    comp.cancel.set()
    comp.ui_lock.__exit__()
    run_to_end(comp, start=False)
    assert comp.status == "cancelled"
    after = {e: len(comp.results[e].steps) for e in comp.engines}
    assert all(after[e] <= before[e] + 1 for e in comp.engines), (before, after)


def test_a_killed_engine_process_fails_the_run_keeps_its_tokens_and_the_next_run_gets_a_fresh_one(tmp_path):
    """kill -9 of the engine process mid-run: the run ends as failed with the reason, keeping what it had streamed
    (on screen and in the history), and the next run is served by a fresh engine process."""
    engines = EngineProcess(tiny_chat_backend).start()
    try:
        history = History(tmp_path / "h.db")
        comp = Comparison(engines, request(max_new=200, method="draft"), "fair", history, engines.describe())
        comp.start()
        until_tokens(comp, "baseline", 5)
        killed = engines.pid
        os.kill(killed, signal.SIGKILL)
        comp.ui_lock.__exit__()
        run_to_end(comp, start=False)
        assert comp.status == "failed" and "killed by SIGKILL" in comp.error
        kept = comp.results["baseline"]
        assert len(kept.output_tokens) >= 5 and all(isinstance(t, TokenEvent) for t in kept.tokens)
        row = history.run(comp.run_id)
        assert row["status"] == "failed" and "killed by SIGKILL" in row["error"]
        assert len(history.results(comp.run_id)["baseline"].output_tokens) >= 5  # what it streamed is saved
        again = run_to_end(Comparison(engines, request(), "fair", history, engines.describe()))
        assert again.status == "completed" and again.comparison().identical
        assert engines.pid != killed and engines.restarts == 1
        with pytest.raises(ProcessLookupError):
            os.kill(killed, 0)
    finally:
        engines.close()


def test_an_engine_process_that_cannot_load_says_why():
    with pytest.raises(ModelError, match="planted by the test"):
        EngineProcess(failing_backend).start()
    with pytest.raises(EngineProcessError, match="ended while loading .killed by SIGKILL"):
        EngineProcess(dying_backend).start()


def test_close_leaves_no_engine_process():
    engines = EngineProcess(tiny_chat_backend).start()
    pid = engines.pid
    engines.close()
    engines.close()  # twice is fine
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.fixture(scope="module")
def wider():
    """Engines whose passes take milliseconds: a run long enough for CPU counters that tick every 10 ms."""
    process = EngineProcess(partial(tiny_chat_backend, hidden=512)).start()
    yield process
    process.close()


@pytest.mark.slow  # wider models: half a minute
def test_a_cpu_hog_during_the_passes_marks_the_run_noisy_and_a_quiet_run_is_not(wider):
    """Noise is what others take during the engines' timed passes: a real process spinning beside the run marks it
    noisy; the same run without it is quiet (the console's own work between passes is not noise)."""
    import subprocess
    import sys

    engines = wider
    req = request(max_new=200, method="draft", dynamic_k=False, k=3)
    quiet = run_to_end(Comparison(engines, req, "fair", None, {}))
    if quiet.machine["noisy"]:
        # a machine with nothing else to do still runs its daemons: a blip that falls in the passes is real noise,
        # rightly reported; a reading that counts the console's own work (the fault this test is for) repeats
        quiet = run_to_end(Comparison(engines, req, "fair", None, {}))
    # outside the console's process tree (each started by a process that ends at once), as a compile or another
    # program would be: the console's own children are its engines
    spin = "import time\nend = time.time() + 60\nwhile time.time() < end: pass"
    start = (f"import subprocess, sys\nprint(subprocess.Popen([sys.executable, '-c', {spin!r}], "
             "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
    hog = int(subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, check=True).stdout)
    time.sleep(1.0)  # spinning
    try:
        busy = run_to_end(Comparison(engines, replace(req, max_new_tokens=48), "fair", None, {}))
    finally:
        os.kill(hog, signal.SIGKILL)
    assert busy.machine["noisy"] and max(busy.machine["others_in_passes"].values()) > 0.5, busy.machine
    assert not quiet.machine["noisy"], quiet.machine


def test_one_device_split_in_two_engine_processes_each_held_to_its_share(backend):
    """--local-memory: the baseline (the target alone) and the speculative engine in two engine processes, each with
    its own share of the device's memory (on this CPU: checked against the loaded models; on a GPU also the
    allocator's cap). Both serve one comparison of the console's default method (hybrid), each from its own process,
    with the output the one-process engines give; a share too small for the models refuses to start and says why."""
    from engine.process.split import SplitEngines, parse_shares

    split = SplitEngines.start(partial(tiny_chat_backend, target_only=True), tiny_chat_backend,
                               parse_shares("0.3,0.6"))
    try:
        memory = split.memory()["engines"]
        assert (memory["baseline"]["share"], memory["speculative"]["share"]) == (0.3, 0.6)
        assert split.capabilities.fair_strategy == "alternate"  # a CPU: the engines share its cores
        comp = run_to_end(Comparison(split, request(), "fair", None, {}))
        pids = {e: r.metrics.engine_pid for e, r in comp.results.items()}
        assert pids == {"baseline": split.baseline_engines.pid, "speculative": split.speculative_engines.pid}
        assert len({*pids.values(), os.getpid()}) == 3
        here = run_to_end(Comparison(backend, request(), "fair", None, {})).results
        assert all(comp.results[e].output_ids == here[e].output_ids for e in ("baseline", "speculative"))
    finally:
        split.close()
    with pytest.raises(ModelError, match="more than this engine's share"):
        SplitEngines.start(tiny_chat_backend, tiny_chat_backend, (1e-9, 0.5))
    for bad in ("0.5", "0.7,0.7", "0,0.5", "a,b"):
        with pytest.raises(SettingsError, match="--local-memory takes two shares"):
            parse_shares(bad)
