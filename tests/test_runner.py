"""A comparison run by specconsole.runner on the tiny backend: saved and rebuilt alike, fair mode's clocks, Stop, one
engine's error, a busy machine, the page's turn at the lock, and the meta saved with the run."""

import threading
import time

import pandas as pd
import pytest

from engine.drafting import Drafting
from engine.request import Request
from engine.comparison import ComparisonFigures
from specconsole import charts
from specconsole.export import export_csv
from specconsole.history import History
from specconsole.render import figures_html, tokens_html
from engine.clock import EngineClock
from specconsole.runner import Comparison
from tests.conftest import PassLog, hello_there, run_to_end


@pytest.mark.parametrize("mode", ["fair", "race"])
def test_comparison_saved_and_rebuilt(backend, tmp_path, mode):
    history = History(tmp_path / "h.db")
    req = Request(prompt="=cmd|' /C calc'!A0 <script>", max_new_tokens=24, drafting=Drafting(method="draft", k=3))
    meta = {"category": "code", "backend": "local", "method": "draft"}
    comp = run_to_end(Comparison(backend, req, mode, history, meta))
    assert comp.status == "completed"
    c = comp.comparison()
    assert c.identical is True

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
    req = hello_there(40, k=2)
    comp = Comparison(backend, req, "fair", None, {})
    log = PassLog(backend, {id(req): "speculative"})
    comp.backend = log
    run_to_end(comp)
    assert log.watched["baseline"] >= 80 and log.watched["speculative"] >= 40  # a token and a step per pass
    assert log.moved == [], log.moved[:5]
    for engine, r in comp.results.items():
        own = sum(st.verify_ms + st.draft_ms for st in r.steps) / 1000
        assert own <= r.total_s <= log.clocks[engine](), engine


def test_turn_gaps_stand_where_the_page_waits_and_are_not_timed(backend):
    """benchmarks.turn_gap's premise: its gap is waited where a fair turn waits for the page, before every turn, and
    the engines' clocks do not count it (the run's wall time does)."""
    from benchmarks.turn_gap import Gap, run

    req = hello_there(12, k=2)
    gap = Gap(0.02)
    t = time.perf_counter()
    results = run(backend, req, [], gap)
    wall = time.perf_counter() - t
    passes = sum(len(r.steps) for r in results.values())
    assert gap.waits >= passes  # a wait before every turn, and a turn per target pass
    # each engine's last turn only finds its stream ended, and may wait after the run ended: not within `wall`
    assert sum(r.total_s for r in results.values()) < wall - 0.02 * (gap.waits - len(results))


def test_a_turn_that_fails_before_its_pass_ends_the_run_with_the_reason(backend):
    """A failure in a fair turn's own waiting or measuring (not in an engine) is reported as that engine's error:
    the turns' thread does not die and leave the run unfinished (a page waiting forever)."""

    class Broken:
        def is_set(self):
            return False

        def wait(self, timeout=None):
            raise RuntimeError("the page's wait broke")

        def set(self):
            pass

        def clear(self):
            pass

    comp = Comparison(backend, hello_there(8, k=2), "fair", None, {})
    comp.page_idle = Broken()
    run_to_end(comp)
    assert all("the page's wait broke" in r.error for r in comp.results.values())


def test_whole_run_turns_start_on_a_quiet_machine(backend, monkeypatch):
    """Sequential turns (a backend whose engines share the cores and run a whole request per turn, like managed
    llama.cpp servers): the page draws while a turn streams, so every turn first waits for a quiet machine, not only
    the turns after the page's word."""
    import dataclasses

    from specconsole.machine import ConsoleWork

    waits = []
    monkeypatch.setattr(ConsoleWork, "wait_until_quiet", lambda self: waits.append(time.perf_counter()))
    monkeypatch.setattr(backend, "capabilities", dataclasses.replace(backend.capabilities, fair_strategy="sequential"))
    comp = run_to_end(Comparison(backend, Request(prompt="hello there", max_new_tokens=8,
                                                  drafting=Drafting(method="draft", k=2)),
                                 "fair", None, {}))
    assert all(r.finish_reason == "length" for r in comp.results.values())
    for thread in comp._threads:  # its turns' thread may still be finding the ended streams: it waits there too
        thread.join(10)
    assert len(waits) >= len(comp.engines)
    monkeypatch.setattr(backend, "capabilities", dataclasses.replace(backend.capabilities, fair_strategy="alternate"))
    waits.clear()
    run_to_end(Comparison(backend, hello_there(8, k=2), "fair", None, {}))
    assert not waits  # turns of a pass each wait only after the page drew (no page here)


def test_the_turn_after_the_pages_drawing_goes_to_each_engine_alike(backend, monkeypatch):
    """The turn after the page drew an update is at a disadvantage (the browser's leftover work, the wait before it).
    Here the page draws before every other turn: in strict alternation every one of those turns would be the
    baseline's (the page's speedup came out 8-11 % above the API's that way, docs/page-cost.md)."""
    from specconsole.machine import ConsoleWork

    class EveryOtherTurn:  # page_idle of a page that has drawn an update before every other turn
        def __init__(self):
            self.asked, self.drew = 0, False

        def is_set(self):
            self.asked += 1
            return self.asked % 2 == 0

        def wait(self, timeout=None):
            self.drew = True
            return True

        def set(self):
            pass

        def clear(self):
            pass

    page, turns = EveryOtherTurn(), []
    start = ConsoleWork.start

    def noting_start(self, engine=None):
        turns.append((engine, page.drew))
        page.drew = False
        start(self, engine)

    monkeypatch.setattr(ConsoleWork, "start", noting_start)
    monkeypatch.setattr(ConsoleWork, "wait_until_quiet", lambda self: None)
    comp = Comparison(backend, hello_there(40, k=2), "fair", None, {})
    comp.page_idle = page
    run_to_end(comp)
    assert comp.comparison().identical
    both = max(i for i, (engine, _) in enumerate(turns) if engine == "speculative")  # while both engines ran
    after_draw = [engine for engine, drew in turns[:both] if drew]
    counts = {e: after_draw.count(e) for e in comp.engines}
    assert len(after_draw) >= 10 and max(counts.values()) - min(counts.values()) <= 1, counts


def test_whole_run_turns_stream_to_the_page(backend, monkeypatch):
    """Sequential turns (a whole run each): the page sees an engine's tokens while its run goes on, not at its end."""
    import dataclasses

    monkeypatch.setattr(backend, "capabilities", dataclasses.replace(backend.capabilities, fair_strategy="sequential"))
    original = backend.baseline

    def slow(req, cancel=None, clock=None):  # a run long enough to be watched
        for event in original(req, cancel, clock):
            time.sleep(0.005)
            yield event

    monkeypatch.setattr(backend, "baseline", slow)
    comp = Comparison(backend, hello_there(60, k=2), "fair", None, {})
    comp.start()
    seen_mid_run, deadline = False, time.monotonic() + 60
    while not comp.poll(0.05):
        baseline = comp.live["baseline"]
        seen_mid_run |= bool(baseline.result.tokens) and not baseline.finished
        assert time.monotonic() < deadline
    assert seen_mid_run


def test_engine_clock_pauses():
    clock = EngineClock()
    clock.resume()
    clock.pause()
    frozen = clock()
    assert clock() == frozen


def test_cancel_keeps_a_cancelled_run(backend, tmp_path):
    history = History(tmp_path / "h.db")
    req = Request(prompt="hello", max_new_tokens=4000 // 20, drafting=Drafting(method="draft", k=2))
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
    comp = run_to_end(Comparison(backend, Request(prompt="hi", max_new_tokens=12, drafting=Drafting(k=2)), "fair",
                                 history, {}))
    assert comp.results["baseline"].finish_reason == "length"  # the other engine finished
    assert "the draft fell over" in comp.results["speculative"].error
    row = history.run(comp.run_id)
    assert row["status"] == "failed" and "the draft fell over" in row["error"]


def test_busy_machine_marks_the_run_noisy():
    """Another process that takes a core during the run makes its timings suspect, and the figures say so."""
    import subprocess
    import sys
    import time

    from specconsole.machine import MachineLoad

    load = MachineLoad()
    spin = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    hog = subprocess.Popen([sys.executable, "-c", spin])
    hog.wait()
    time.sleep(0.05)
    result = load.result()
    assert result["noisy"] and result["other_cores"] > 0.5, result
    assert "other processes used" in result["noise"]
    html = figures_html(None, None, ComparisonFigures(), "fair", None, result)
    assert "machine during the run" in html and "noisy" in html


def _hog(seconds: float):
    import subprocess
    import sys

    spin = f"import sys, time\nprint(flush=True)\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    hog = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
    hog.stdout.readline()  # spinning
    return hog


def test_the_consoles_own_servers_are_not_a_disturbance():
    """A managed vLLM or llama.cpp server is a process the console started before the run: its work is the run's
    engines, not another process's, and does not count towards a noisy run."""
    from specconsole.machine import MachineLoad

    server = _hog(2.5)  # running
    load = MachineLoad()
    time.sleep(1.0)
    result = load.result()
    server.wait()
    # its core counts as the console's (before: as another process's, which marked every such run noisy)
    assert result["console_cores"] > 0.5, result


def test_other_processes_are_counted_in_the_passes_they_overlap():
    """Another process's CPU time is charged to the engine whose timed pass it overlapped: a disturbance that falls
    on the baseline's passes and not on the speculative engine's shows as such (it biases the speedup)."""
    from specconsole.machine import MachineLoad

    load = MachineLoad()
    for _ in range(3):
        hog = _hog(0.3)
        load.console.start("baseline")
        hog.wait()
        load.console.stop()
        load.console.start("speculative")
        time.sleep(0.3)
        load.console.stop()
    result = load.result()
    passes = result["others_in_passes"]
    assert passes["baseline"] > 0.5 and passes["speculative"] < 0.3, passes
    assert result["noisy"]
    html = figures_html(None, None, ComparisonFigures(), "fair", None, result)  # the page says where it fell
    assert f"passes: baseline {passes['baseline']:.2f}, speculative {passes['speculative']:.2f}" in html


def test_the_wait_for_a_quiet_machine_gives_up_on_a_busy_one():
    """Before a pass that follows the page's drawing, the turn waits until other processes take no CPU; a machine
    that stays busy is waited for at most twice per run (each wait at most QUIET_LIMIT_S), not before every pass."""
    from specconsole import machine

    hog = _hog(3.0)
    work = machine.ConsoleWork()
    waits = []
    for _ in range(4):
        t = time.perf_counter()
        work.wait_until_quiet()
        waits.append(time.perf_counter() - t)
    hog.kill()
    assert work.quiet_given_up, waits
    assert waits[2] < 0.01 and waits[3] < 0.01, waits
    assert all(w < machine.QUIET_LIMIT_S + 0.2 for w in waits), waits


def test_noisy_flag_is_saved_and_exported(backend, tmp_path):
    history = History(tmp_path / "h.db")
    req = Request(prompt="hello", max_new_tokens=8, drafting=Drafting(method="draft", k=2))
    comp = run_to_end(Comparison(backend, req, "fair", history, {"category": "chat"}))
    machine = comp.checks()["speculative"]
    assert {"noisy", "other_cores", "load_average"} <= machine.keys()
    assert history.run(comp.run_id)["noisy"] == int(machine["noisy"])
    summary, _ = export_csv(history, tmp_path / "csv")
    assert pd.read_csv(summary).loc[0, "noisy"] == int(machine["noisy"])


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

    assert run_meta(backend, Request(prompt="x", drafting=Drafting(method="ngram"))) | {"target_model": ""} == {
        "backend": "local", "target_model": "", "draft_model": None, "method": "ngram"}
    assert run_meta(backend, Request(prompt="x", drafting=Drafting(method="draft")))["draft_model"] == "tiny-draft"
    served = run_meta(ServerLike(backend), Request(prompt="x", drafting=Drafting(method="draft")))
    assert served["method"] == "eagle" and served["draft_model"] == "/m/eagle"
