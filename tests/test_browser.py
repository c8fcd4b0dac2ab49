"""A real browser drives the real console: Debian's Chromium through playwright, the app in a subprocess with the
small SmolLM2 preset, a real SQLite file."""

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from specconsole.run_stream import CHART_EVERY_S
from tests.conftest import CHROMIUM, free_ports, launch_chromium, set_run, skip_or_fail

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"

if not os.path.exists(CHROMIUM):
    skip_or_fail("Debian's chromium is not installed", module=True)


VIEWPORT = {"width": 1500, "height": 1700}
WHOLE_PAGE = {"width": 1500, "height": 3400}  # tall enough for the whole Run tab, charts and all


@pytest.fixture(scope="module")
def console(tmp_path_factory, smol_dir):
    db = tmp_path_factory.mktemp("db") / "history.db"
    port = free_ports(1)[0]
    env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    log = open(tmp_path_factory.mktemp("log") / "console.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "launch.py", "--preset", "smollm2-ngram", "--port", str(port), "--db", str(db)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, "the console exited at start"
            time.sleep(0.5)
    else:
        pytest.fail("the console did not come up")
    yield url, db
    proc.terminate()
    proc.wait(30)
    log.seek(0)
    print(log.read()[-3000:])


@pytest.fixture(scope="module")
def page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
        yield context.new_page()
        browser.close()


def open_console(page, url):
    page.goto(url)
    page.wait_for_selector("#model-status:has-text('Ready')", timeout=120_000)


def download_csv(page, link_selector: str, path) -> pd.DataFrame:
    """Click a file link in the page, save what the browser downloads, and parse it."""
    link = page.locator(link_selector)
    link.wait_for(timeout=30_000)
    with page.expect_download() as download:
        link.click()
    download.value.save_as(path)
    return pd.read_csv(path)


def wait_for_run(page) -> None:
    """Until both panels say how their run ended ("length · 32 tokens") and the final figures are in."""
    for panel in ("#baseline-panel", "#speculative-panel"):
        page.wait_for_selector(f"{panel} .panel-status:has-text('tokens')", timeout=180_000)
    page.wait_for_selector("#figures:has-text('machine during the run')", timeout=60_000)


def show_charts(page) -> None:
    """Scroll the charts into view: a chart out of view is drawn when it comes into view (assets/live_panel.js)."""
    page.locator("#chart-steps").evaluate("chart => chart.scrollIntoView()")


def test_the_page_comes_with_an_example_and_keeps_what_is_typed_at_once(console, page):
    """The first category's first example is in the page as served; a prompt typed as soon as the box shows is not
    overwritten by anything the page fetches afterwards (an event on load once filled the example in late)."""
    from specconsole.suites import categories, load_suite

    url, _ = console
    page.goto(url)
    box = page.locator("#prompt textarea")
    box.wait_for()
    assert box.input_value() == load_suite(categories()[0])[0].prompt
    box.fill("typed at once")
    page.wait_for_selector("#model-status:has-text('Ready')", timeout=120_000)
    page.wait_for_timeout(2000)
    assert box.input_value() == "typed at once"


def test_run_history_and_csv(console, page, tmp_path):
    from playwright.sync_api import expect

    url, db = console
    open_console(page, url)

    prompt = 'Repeat this JSON exactly, then add a field "age": {"name": "Ada", "city": "London", "langs": ["en", "fr"]}'
    page.fill("#prompt textarea", prompt)
    temperature = page.locator("#temperature input[type=number]")
    temperature.fill("0")
    temperature.press("Enter")
    page.click("#run")
    wait_for_run(page)

    assert page.locator("#baseline-panel .tok.baseline").count() > 5
    assert page.locator("#speculative-panel .tok.accepted").count() > 0
    assert page.locator("#speculative-panel .tok.recovered, #speculative-panel .tok.bonus").count() > 0
    assert page.locator("#baseline-panel .tok.accepted").count() == 0
    figures = page.inner_text("#figures")
    assert "identical to the baseline" in figures
    # steps by drafts accepted, ignored drafts and where the time went, as the saved run's metrics say
    from specconsole.history import History

    saved = History(db)
    spec = saved.results(saved.runs()[0]["id"])["speculative"].metrics
    bars = " · ".join(f"{i}: {n}" for i, n in enumerate(spec.acceptance_histogram))
    assert bars and bars in figures and f"{spec.steps_accepting_nothing:.0%} of the steps accepted nothing" in figures
    assert re.search(r"ignored drafts \(cut off by a stop\)\s+\d+", figures)
    split = " | ".join(f"{getattr(spec, k) / 1000:.2f}" for k in ("drafting_ms", "verifying_ms", "other_ms"))
    assert re.search(r"time: drafting \| target passes \| other \(s\)\s+" + re.escape(split), figures)
    # the tokens chart has drawn a line per engine; the time chart a row per engine, each with its passes
    show_charts(page)
    expect(page.locator("#chart-tokens g.trace.scatter")).to_have_count(2, timeout=30_000)
    assert page.locator("#chart-steps g.trace.bars").count() >= 1
    passes = {e: len(r.steps) for e, r in saved.results(saved.runs()[0]["id"]).items()}
    rows = page.locator("#chart-time .annotation-text").all_text_contents()
    assert [row.split(",")[0] for row in rows] == [f"{e}: {n} target passes" for e, n in passes.items()], rows
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "console.png"), full_page=True)

    page.get_by_role("tab", name="History").click()
    expect(page.locator("#history-table")).to_contain_text("completed", timeout=30_000)
    page.click("#export-all")
    runs = download_csv(page, "#export-files a[download='specconsole_runs.csv']", tmp_path / "runs.csv")
    assert len(runs) == 1 and runs.loc[0, "status"] == "completed" and runs.loc[0, "prompt"].startswith("Repeat")
    assert runs.loc[0, "identical"] == 1
    page.screenshot(path=str(ARTIFACTS / "history.png"), full_page=True)


# Records every chart redraw (gradio's plot component calls window.Plotly.react for each update it receives): the
# chart, when, and each trace's number of points and last x (on the tokens chart: an engine's own clock, seconds).
COUNT_REDRAWS = """() => {
    window.redraws = [];
    const react = window.Plotly.react;
    window.Plotly.react = function (gd, ...rest) {
        const data = Array.isArray(rest[0]) ? rest[0] : (rest[0] && rest[0].data) || [];
        const xs = data.map(t => Array.from(t.x || []));
        window.redraws.push({chart: gd.closest('[id^=chart-]')?.id, t: performance.now(),
                             points: xs.map(x => x.length), last: xs.map(x => x[x.length - 1] ?? null)});
        return react.call(this, gd, ...rest);
    };
}"""


# Tags each panel's first token node the moment it appears, and notes how many tokens the panel had then.
TAG_FIRST_TOKENS = """() => {
    window.first = {};
    window.tagged = {};
    window.firstAt = {};
    window.staleAtFirst = {};
    for (const id of ['baseline-panel', 'speculative-panel']) {
        const root = document.querySelector('#' + id + ' .live-panel');
        const observer = new MutationObserver(() => {
            const token = root.querySelector('.tok');
            if (!token) return;
            window.first[id] = token;
            window.tagged[id] = root.querySelectorAll('.tok').length;
            window.firstAt[id] = performance.now();
            window.staleAtFirst[id] = document.querySelectorAll('.stale-chart').length;
            observer.disconnect();
        });
        observer.observe(root, {childList: true, subtree: true});
    }
}"""


# Records each new value of the figures that count the steps by drafts accepted and split the time, as the page
# shows them during a run.
WATCH_FIGURES = """() => {
    window.seen = {'drafts accepted per step': [], 'time: drafting | target passes | other (s)': []};
    const root = document.querySelector('#figures');
    new MutationObserver(() => {
        for (const label of root.querySelectorAll('.fig-label')) {
            const values = window.seen[label.textContent];
            const value = label.nextElementSibling.firstChild?.textContent;
            if (values && value && values[values.length - 1] !== value) values.push(value);
        }
    }).observe(root, {childList: true, subtree: true, characterData: true});
}"""


def test_live_panels_append_and_charts_throttle(console, page):
    """The page must not take the CPU it measures: tokens already shown are never re-created by later updates, and
    each chart is updated at most once every CHART_EVERY_S during a run, and not as it begins. Nor is the page
    starved: it gets its turn between passes, so its chart updates keep up with the engines, counted in their passes
    (on a fast machine: in seconds of their own clocks), not in wall-clock seconds, which a busy machine stretches
    for the page."""
    url, db = console
    open_console(page, url)
    # long enough for chart updates while it runs (CHART_EVERY_S apart), on a machine a few times faster than a laptop
    set_run(page, "Write a long story about a dragon who learns to bake bread.", 400)
    page.wait_for_function("() => window.Plotly && window.Plotly.react")  # the empty charts are drawn at load
    page.evaluate(COUNT_REDRAWS)
    page.evaluate(TAG_FIRST_TOKENS)
    page.evaluate(WATCH_FIGURES)
    start = page.evaluate("performance.now()")
    page.set_viewport_size(WHOLE_PAGE)  # the charts in view, drawn as their updates come, while the figures fill in
    try:
        page.click("#run")
        wait_for_run(page)
    finally:
        page.set_viewport_size(VIEWPORT)
    end = page.evaluate("performance.now()")
    # the histogram and the time split grew with the run, not only at its end
    for label, values in page.evaluate("window.seen").items():
        assert len(values) >= 2 and values[-1] != values[0], (label, values)
    for panel in ("baseline-panel", "speculative-panel"):
        count_then = page.evaluate(f"window.tagged['{panel}']")
        count_now = page.locator(f"#{panel} .tok").count()
        assert count_now > count_then, f"{panel}: no tokens came after the first update ({count_then})"
        # the very node that was first when the run had just begun is still the panel's first token
        assert page.evaluate(f"""() => window.first['{panel}'].isConnected &&
                                 document.querySelector('#{panel} .tok') === window.first['{panel}']"""), panel
    # nor does Gradio copy the run into the browser's localStorage (its run history rewrites all its records twice a
    # second while a run streams; the History tab keeps the runs)
    assert page.evaluate("Object.keys(localStorage).filter(k => k.startsWith('gradio:run-history'))") == []
    redraws = page.evaluate("window.redraws")
    seconds = (end - start) / 1000
    # the charts are not redrawn as a run begins, only CHART_EVERY_S in (the server's clock starts after the click):
    # until then they show the last run's, faded, and none is faded once the run has ended
    first_token = min(page.evaluate("Object.values(window.firstAt)"))
    early = [r for r in redraws if r["t"] < first_token]
    assert all(r["t"] - start >= CHART_EVERY_S * 1000 for r in early), early
    if not early:
        assert page.evaluate("Object.values(window.staleAtFirst)") == [4, 4]
    assert page.locator(".stale-chart").count() == 0
    for chart in ("chart-steps", "chart-positions", "chart-tokens", "chart-time"):
        drawn = [r for r in redraws if r["chart"] == chart]
        assert drawn, f"{chart} was never redrawn"
        # gradio's plot calls Plotly.react twice for one new value (the value, then its layout pass): an update is a
        # new state of the chart's data
        updates = len({(tuple(r["points"]), tuple(r["last"])) for r in drawn})
        # once every CHART_EVERY_S while running, plus the final update; delivery jitter may bunch two together
        assert updates <= seconds / CHART_EVERY_S + 2, f"{chart}: {updates} updates in {seconds:.1f} s ({drawn})"
    # where the time went: drawn while the run went on (the run lasts more than CHART_EVERY_S), with more bars (both
    # engines' passes) at its end
    bars = [sum(r["points"]) for r in redraws if r["chart"] == "chart-time" and any(r["points"])]
    assert bars and bars[0] < bars[-1], bars
    for row in ("xy", "x2y2"):
        assert page.locator(f"#chart-time .subplot.{row} .trace.bars").count() >= 1, row
    tokens = [r for r in redraws if r["chart"] == "chart-tokens"]
    states = {tuple(r["points"]) for r in tokens if any(r["points"])}
    engine_s = sum(x or 0 for x in tokens[-1]["last"])  # both engines' clocks at their last token
    conn = sqlite3.connect(db)
    (passes,), = conn.execute("SELECT count(*) FROM steps WHERE run_id = (SELECT id FROM runs ORDER BY created_at "
                              "DESC, rowid DESC LIMIT 1)").fetchall()  # both engines' target passes
    conn.close()
    # The page's turn comes after at most one pass, and a chart is due every CHART_EVERY_S: a chart update every
    # 40 passes per second of it (a busy machine: slow passes) or every 3 of them in the engines' time (a fast
    # machine: many passes a second), whichever asks for fewer. Starved, the page waited for whole runs.
    assert len(states) >= min(passes / (40 * CHART_EVERY_S), engine_s / (3 * CHART_EVERY_S)), (
        f"{len(states)} chart updates for {passes} passes and {engine_s:.1f} s of the engines' time")


# Counts, per chart, plotly's relayouts: what its resize does when it lays a chart out and draws it again.
WATCH_RELAYOUTS = """() => {
    window.relayouts = {};
    const watch = (gd) => {
        if (gd.relayoutsWatched || !gd.on) return;
        gd.relayoutsWatched = true;
        const chart = gd.closest('[id^=chart-]')?.id;
        gd.on('plotly_relayout', () => { window.relayouts[chart] = (window.relayouts[chart] || 0) + 1; });
    };
    new MutationObserver(() => document.querySelectorAll('.js-plotly-plot').forEach(watch))
        .observe(document.body, {childList: true, subtree: true});
    document.querySelectorAll('.js-plotly-plot').forEach(watch);
}"""
CHARTS = ("chart-steps", "chart-positions", "chart-tokens", "chart-time")


def test_each_chart_update_is_drawn_once_and_a_resized_window_redraws_them(console, page):
    """Gradio follows every chart update with plotly's resize, which lays the chart out and draws it a second time
    100 ms later: the page skips that where the chart still fits its box, and keeps it where the box changed."""
    url, _ = console
    open_console(page, url)
    set_run(page, "Write a short poem about the sea.", 48)
    page.wait_for_function("() => window.Plotly && window.Plotly.react")
    page.set_viewport_size(WHOLE_PAGE)  # the charts in view
    try:
        page.wait_for_timeout(500)  # past plotly's resize debounce after the window grew
        page.evaluate(WATCH_RELAYOUTS)
        page.click("#run")
        wait_for_run(page)
        page.wait_for_timeout(500)  # past plotly's resize debounce after the end's chart update
        assert page.evaluate("window.relayouts") == {}
        fitting = f"""() => {list(CHARTS)}.map(id => {{
            const gd = document.querySelector('#' + id + ' .js-plotly-plot');
            return Math.abs(gd._fullLayout.width - parseFloat(getComputedStyle(gd).width)) <= 1; }})"""
        assert all(page.evaluate(fitting))
        page.set_viewport_size({"width": 1100, "height": WHOLE_PAGE["height"]})
        page.wait_for_function(f"() => {list(CHARTS)}.every(id => window.relayouts[id] >= 1)", timeout=10_000)
        assert all(page.evaluate(fitting))
    finally:
        page.set_viewport_size(VIEWPORT)


def test_charts_out_of_view_are_drawn_when_they_come_into_view(console, page):
    """Below the fold the charts' drawing was the browser's largest cost during a short run, for nothing the user
    saw: a chart out of view is not drawn until it comes into view, and then with the run's last update."""
    from playwright.sync_api import expect

    url, db = console
    open_console(page, url)
    set_run(page, "Write a short poem about the sea.", 24)
    page.click("#run")
    wait_for_run(page)
    page.wait_for_timeout(500)  # past plotly's resize debounce after the end's chart update
    tops = page.evaluate("() => [...document.querySelectorAll('[id^=chart-]')].map(c => c.getBoundingClientRect().top)")
    assert len(tops) == 4 and min(tops) > VIEWPORT["height"], f"the charts are in view: {tops}"
    assert page.locator("#chart-tokens g.trace.scatter").count() == 0  # not drawn: out of view
    # their places are kept: the page does not jump when they draw
    heights = page.evaluate("() => [...document.querySelectorAll('[id^=chart-] [data-testid=plotly]')]"
                            ".map(gd => gd.getBoundingClientRect().height)")
    assert len(heights) == 4 and min(heights) >= 250, heights
    show_charts(page)
    expect(page.locator("#chart-tokens g.trace.scatter")).to_have_count(2, timeout=10_000)
    # drawn with the run's last update: each engine's line has one point per output token
    conn = sqlite3.connect(db)
    tokens = dict(conn.execute("SELECT engine, count(*) FROM tokens WHERE run_id = (SELECT id FROM runs ORDER BY "
                               "created_at DESC, rowid DESC LIMIT 1) AND kind != 'rejected' GROUP BY engine"))
    conn.close()
    points = page.evaluate("""() => document.querySelector('#chart-tokens .js-plotly-plot').data
                                  .map(trace => [trace.name, trace.x.length])""")
    assert dict(points) == tokens, (points, tokens)


def test_presenter_view_keys_and_the_same_run_across_switches(console, page):
    """A projector at 1280x720: ?view=present keeps the two panels (large, side by side), the legend and three
    headline figures; Enter runs, Escape stops; leaving and re-entering the view does not disturb the run."""
    url, _ = console
    page.set_viewport_size({"width": 1280, "height": 720})
    try:
        page.goto(url + "?view=present")
        page.wait_for_selector("#model-status:has-text('Ready')", timeout=120_000)
        # the view is Gradio's js= hook's, which runs once the app has mounted (the status line can be there first)
        page.wait_for_function("() => document.body.classList.contains('present')", timeout=30_000)
        assert not page.is_visible("#prompt") and not page.is_visible("#chart-tokens")
        assert not page.get_by_role("tab", name="History").is_visible()
        boxes = [page.locator(f"#{e}-panel .tokens").bounding_box() for e in ("baseline", "speculative")]
        assert boxes[0]["x"] + boxes[0]["width"] <= boxes[1]["x"] and min(b["width"] for b in boxes) >= 560
        assert min(b["height"] for b in boxes) >= 300  # most of a 720-pixel screen, and the rest fits around them
        assert page.evaluate("parseFloat(getComputedStyle(document.querySelector('#baseline-panel .tokens')).fontSize)") >= 22

        page.click("#present-toggle")  # out, to type the prompt; the URL follows the view
        assert "view=present" not in page.url and page.is_visible("#prompt")
        set_run(page, "Write a long story about a lighthouse keeper and the sea, in many short paragraphs.", 1500)
        page.click("#present-toggle")
        assert "view=present" in page.url
        page.locator("body").press("Enter")  # Run
        page.wait_for_function("() => document.querySelectorAll('#speculative-panel .tok').length >= 10",
                               timeout=120_000)
        page.evaluate("window.firstToken = document.querySelector('#baseline-panel .tok')")
        shown = page.locator("#baseline-panel .tok").count()
        page.click("#present-toggle")  # the normal view: the same run goes on in the same panels
        page.wait_for_function(f"() => document.querySelectorAll('#baseline-panel .tok').length > {shown}",
                               timeout=120_000)
        assert page.evaluate("window.firstToken === document.querySelector('#baseline-panel .tok')")
        page.click("#present-toggle")
        page.wait_for_selector("#figures .fig.headline", timeout=60_000)
        assert page.locator("#figures .fig.headline").count() == 3
        assert page.locator("#figures .fig:not(.headline)").first.is_hidden()
        page.evaluate("window.scrollTo(0, 0)")
        for selector in (".legend", "#present-toggle", "#figures .fig.headline"):  # all of it on one screen
            box = page.locator(selector).first.bounding_box()
            assert box["y"] >= 0 and box["y"] + box["height"] <= 720, (selector, box)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "presenter.png"))
        page.locator("body").press("Escape")  # Stop
        for panel in ("#baseline-panel", "#speculative-panel"):
            page.wait_for_selector(f"{panel} .panel-status:has-text('cancelled')", timeout=120_000)
    finally:
        page.set_viewport_size(VIEWPORT)


def test_history_exports_a_replay_of_the_selected_run(console, page, tmp_path):
    url, _ = console
    open_console(page, url)
    page.get_by_role("tab", name="History").click()
    page.click("#refresh-history")
    first = page.locator("#history-table [data-testid='cell-0-0']")
    first.wait_for(timeout=30_000)
    run_id = first.inner_text().strip()
    first.click()
    page.wait_for_function(f"() => document.querySelector('#selected-runs textarea').value.includes('{run_id}')")
    page.click("#export-replay")
    link = page.locator(f"#export-files a[download='replay-{run_id}.html']")
    link.wait_for(timeout=30_000)
    with page.expect_download() as download:
        link.click()
    path = tmp_path / "replay.html"
    download.value.save_as(path)
    html = path.read_text(encoding="utf-8")
    assert run_id in html and 'type="application/json"' in html and "<script src" not in html


def test_page_is_up_before_models_finish(tmp_path):
    """The page answers while the models are still loading (here: a preset whose weights are not cached)."""
    port = free_ports(1)[0]
    env = dict(os.environ, HF_HUB_OFFLINE="1", SPECCONSOLE_CACHE=str(tmp_path / "empty-cache"))
    proc = subprocess.Popen(
        [sys.executable, "launch.py", "--preset", "smollm2-ngram", "--port", str(port), "--db", str(tmp_path / "h.db")],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        import httpx

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail("the page did not come up within 60 s")
        # the models cannot be ready yet: the weights still have to be fetched and dequantized
        assert not (tmp_path / "empty-cache" / "models" / "smollm2-135m-instruct" / "config.json").exists()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the app and the weight download it started
        proc.wait(30)


def test_workbench_suite_advice_and_csv(console, page, tmp_path):
    from playwright.sync_api import expect

    url, _ = console
    open_console(page, url)
    page.get_by_role("tab", name="Workbench").click()
    page.click("#run-suite")  # default: the code suite, 2 prompts, no sweep
    expect(page.locator("#suite-status")).to_contain_text("finished", timeout=300_000)
    expect(page.locator("#suite-table")).to_contain_text("code", timeout=30_000)
    expect(page.locator("#suite-speedup g.trace.bars")).to_have_count(1, timeout=30_000)
    advice = page.inner_text("#advice")
    # two prompts cannot decide either way: undecided, with the interval and how many prompts would decide it (or,
    # where the median lands in the 1.00-1.05x band, that no number of prompts will)
    assert "code: undecided" in advice and "95 % CI" in advice and "over 2 prompts (2 runs)" in advice
    assert "2 prompts cannot decide" in advice
    assert "prompts would decide it" in advice or "more prompts will not decide it" in advice
    assert "second model" not in advice  # the smollm2-ngram preset drafts by n-gram lookup
    page.click("#export-suite")
    categories = download_csv(page, "#suite-files a[download$='_categories.csv']", tmp_path / "categories.csv")
    assert list(categories["category"]) == ["code"] and categories.loc[0, "runs"] == 2
    assert categories.loc[0, "prompts"] == 2
    assert categories.loc[0, "speedup_low"] <= categories.loc[0, "speedup"] <= categories.loc[0, "speedup_high"]
    assert page.locator("#suite-files a[download$='.html']").count() == 1
    page.screenshot(path=str(ARTIFACTS / "workbench.png"), full_page=True)


def test_nway_comparison_fills_a_panel_per_engine(console, page):
    """Compare with one more configuration: a 3-way run (baseline, n-gram with dynamic K, n-gram with K = 2 fixed)
    fills three panels and the engines table, draws a line per engine, and leaves the unused panels hidden."""
    from playwright.sync_api import expect

    url, _ = console
    open_console(page, url)
    set_run(page, 'Repeat exactly: {"name": "Ada", "city": "London", "langs": ["en", "fr"]}', 24)
    expect(page.locator("#speculative-2-panel")).to_be_hidden()
    page.locator("#compare-with label", has_text="n-gram K=2 fixed").click()
    page.click("#run")
    for panel in ("#baseline-panel", "#speculative-panel", "#speculative-2-panel"):
        page.wait_for_selector(f"{panel} .panel-status:has-text('tokens')", timeout=180_000)
    page.wait_for_selector("#figures:has-text('machine during the run')", timeout=60_000)
    assert page.locator("#speculative-2-panel .tok.accepted, #speculative-2-panel .tok.bonus, "
                        "#speculative-2-panel .tok.recovered").count() > 0
    expect(page.locator("#speculative-3-panel")).to_be_hidden()
    expect(page.locator("#speculative-4-panel")).to_be_hidden()
    rows = page.locator("#figures .engines-table tbody tr")
    expect(rows).to_have_count(3)
    assert "n-gram K=2" in rows.nth(2).inner_text() and "identical" in rows.nth(2).inner_text()
    show_charts(page)
    expect(page.locator("#chart-tokens g.trace.scatter")).to_have_count(3, timeout=30_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "console-nway.png"), full_page=True)
