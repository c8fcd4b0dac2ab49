"""What the page costs the engines it measures. The same greedy comparison, in fair mode, on the same engine process
(engine.process, as the console runs its engines), through the page's update path (the Run button's handler, served
by Gradio and read by a client in another process) and through the API (specconsole.runner.Comparison alone, as
`launch.py demo` drives it): the same tokens and the same passes, and the console's own threads other than the
engines' do (almost) no work while a pass is timed. The disturbance is counted in CPU seconds of those threads
(specconsole.machine.ConsoleWork), not in wall-clock time, so a busy machine does not decide the test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.process.client import EngineProcess
from engine.request import build_request
from specconsole import runner
from specconsole.history import History
from specconsole.host import ModelHost
from specconsole.runner import Comparison
from tests.conftest import free_ports, run_to_end, set_run
from tests.engine_factories import tiny_chat_backend

PROMPT = "Write a function that adds two numbers, then explain it line by line."
NEW_TOKENS = 160
PAGE_CORES = 0.05  # half the noise threshold (specconsole.machine.NOISY_CORES): the page alone never makes a run noisy

CLIENT = """
import sys
from gradio_client import Client
client = Client(sys.argv[1], verbose=False)
# the Run tab's inputs, in RunForm's order: prompt, category, method, k, dynamic_k, confidence, draft_vocab, fallback,
# temperature, top_p, max_new, seed, mode, show_rejected, compare_with
job = client.submit(sys.argv[2], None, "ngram", 3, False, 0.0, 0, False, 0.0, 1.0, int(sys.argv[3]), 0, "fair",
                    True, [], api_name="/run")
updates = sum(1 for _ in job)
print(updates)
"""


@pytest.fixture(scope="module")
def engines():
    """The tiny models in an engine process, as the console runs its engines (engine.process)."""
    process = EngineProcess(tiny_chat_backend).start()
    yield process
    process.close()


@pytest.fixture(scope="module")
def console(engines, tmp_path_factory):
    from specconsole.app import launch

    history = History(tmp_path_factory.mktemp("page") / "history.db")
    host = ModelHost("tiny", lambda progress: engines).start()
    assert host.wait(60)
    port = free_ports(1)[0]
    app = launch(host, history, "127.0.0.1", port, prevent_thread_lock=True)
    yield f"http://127.0.0.1:{port}/", history
    app.close()


def _through_page(url: str, history: History) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-c", CLIENT, url, PROMPT, str(NEW_TOKENS)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = history.runs(limit=1)[0]
    return int(done.stdout.split()[-1]), run


def _steps(history: History, run_id: str) -> list[int]:
    results = history.results(run_id)
    return [len(results[e].steps) for e in ("baseline", "speculative")]


def test_the_page_does_no_work_while_a_pass_is_timed(console, engines):
    url, history = console
    updates, run = _through_page(url, history)
    comparison = json.loads(run["comparison"])
    assert updates >= 4  # the page streamed: updates during the run, not only the layout and the end

    api = run_to_end(Comparison(engines, build_request(PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.0,
                                                       method="ngram", k=3, dynamic_k=False, draft_confidence=0.0),
                                "fair", None, {}))
    # the same work: the same passes, the same output
    assert comparison["identical"] and api.comparison().identical
    assert [len(api.results[e].steps) for e in ("baseline", "speculative")] == _steps(history, run["id"])
    # the console's own threads spent (almost) nothing during the timed passes: Gradio serialised each update
    # between two passes. The few milliseconds left are its event loop writing the queued message to the socket.
    assert comparison["page_cores"] <= PAGE_CORES and api.machine["page_cores"] <= PAGE_CORES, (comparison, api.machine)


def test_without_waiting_for_the_page_its_work_lands_in_the_timed_passes(console, monkeypatch):
    """The measurement itself: with the turns not waiting for Gradio, its serialisation overlaps the passes and is
    counted (so a run disturbed by its own page says so)."""
    url, history = console
    cost, waiting = {}, runner.PAGE_WAIT_S
    for wait in (waiting, 0.0):
        monkeypatch.setattr(runner, "PAGE_WAIT_S", wait)
        cost[wait] = json.loads(_through_page(url, history)[1]["comparison"])["page_cpu_s"]
    print("page_cpu_s by wait", cost)
    assert cost[0.0] > cost[waiting]


@pytest.fixture(scope="module")
def page(browser):
    yield browser.new_context(viewport={"width": 1500, "height": 1700}).new_page()


def test_a_browser_run_waits_for_the_page_between_passes(console, page):
    """A real Chromium's run in fair mode: the engines waited between passes while the page handed its updates over
    (waited_s), and the console's own threads did (almost) nothing during the timed passes."""
    url, history = console
    page.goto(url)
    page.wait_for_selector("#model-status:has-text('Ready')", timeout=60_000)
    set_run(page, PROMPT, NEW_TOKENS)
    page.click("#run")
    page.wait_for_selector("#speculative-panel .live-panel[data-final='yes']", timeout=300_000)
    page.wait_for_selector("#baseline-panel .live-panel[data-final='yes']", timeout=60_000)
    comparison = json.loads(history.runs(limit=1)[0]["comparison"])
    assert comparison["waited_s"] > 0 and comparison["page_cores"] <= PAGE_CORES, comparison


def test_the_page_does_not_keep_the_charts_it_replaced(console, browser, monkeypatch):
    """Gradio mounts a new plotly graph for every chart update, and plotly's listeners kept each old one alive: about
    600 DOM nodes and 150 listeners more per comparison, for as long as the page stayed open (a talk's evening of
    runs). Counted after a forced garbage collection, runs 2 to 4 keep what run 1 left; the charts still show after
    a switch to another tab and back."""
    from benchmarks.page import LAST_RUN, page_kept
    from specconsole import run_stream

    monkeypatch.setattr(run_stream, "CHART_EVERY_S", 0.5)  # several chart updates a run
    url, _ = console
    # tall enough for the charts to be in view, and drawn (a chart out of view is drawn once it comes into view)
    page = browser.new_context(viewport={"width": 1500, "height": 3400}).new_page()
    page.goto(url)
    page.wait_for_selector("#model-status:has-text('Ready')", timeout=60_000)
    set_run(page, PROMPT, NEW_TOKENS)
    cdp = page.context.new_cdp_session(page)
    cdp.send("Performance.enable")

    counts = []
    for _ in range(4):
        before = page.evaluate(LAST_RUN)
        page.click("#run")
        page.wait_for_function("""(before) => ['#baseline-panel', '#speculative-panel'].every(id => {
            const p = document.querySelector(id + ' .live-panel');
            return p.dataset.run && p.dataset.run !== before && p.dataset.final === 'yes'; })""", arg=before,
                               timeout=300_000)
        page.wait_for_timeout(500)  # the end's chart draws (and plotly's second draw)
        counts.append(page_kept(cdp))
    page.get_by_role("tab", name="History").click()
    page.get_by_role("tab", name="Run").click()
    shown = page.evaluate("['#chart-steps', '#chart-positions', '#chart-tokens', '#chart-time'].map(id => "
                          "document.querySelectorAll(id + ' .js-plotly-plot .main-svg').length)")
    page.close()
    grown = {name: counts[-1][name] - counts[0][name] for name in counts[0]}
    assert grown["page_nodes"] < 150 and grown["page_listeners"] < 30, counts
    assert all(shown), shown


COUNT_FRAMES = """window.frames_asked = 0;
const ask = window.requestAnimationFrame.bind(window);
window.frames_from = {};
window.requestAnimationFrame = (callback) => {
  window.frames_asked++;
  const who = String(callback).slice(0, 60);
  window.frames_from[who] = (window.frames_from[who] || 0) + 1;
  return ask(callback);
};"""


def test_an_idle_page_asks_for_few_frames(console, browser):
    """Gradio's status tracker asks for every animation frame while nothing happens (60 a second, 0.06 core of the
    engines' two); the page's first script lets its counter run once a second. Counted below that script: the frame
    requests that reach the browser (the test's counter is installed before the page's scripts, ours wraps it). The
    page's own transitions after loading take a few seconds: the page must become quiet, within 30 s."""
    url, _ = console
    page = browser.new_context().new_page()
    page.add_init_script(COUNT_FRAMES)
    page.goto(url)
    page.wait_for_selector("#model-status:has-text('Ready')", timeout=60_000)
    windows = []
    for _ in range(10):
        page.evaluate("window.frames_asked = 0; window.frames_from = {}")
        page.wait_for_timeout(3000)
        windows.append((page.evaluate("window.frames_asked"), page.evaluate("window.frames_from")))
        if windows[-1][0] <= 15:  # three seconds: 180 without the throttle
            break
    page.close()
    assert windows[-1][0] <= 15, windows
