"""Faults with the real parts: Debian's Chromium (playwright) drives the real console, a process of its own with the
SmolLM2 n-gram preset, on a real SQLite file that starts with a long history (10,000 runs, tests/big_history.py).
One console serves the module; the kill test kills it and starts it again on the same file; the full-disk test runs
a second console, in the test's process, whose database file it stops from growing."""

import argparse
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.events import TokenKind
from engine.comparison import ComparisonFigures
from engine.exact.decode import _Recorder
from engine.stops import StopConditions
from specconsole import backends
from specconsole.history import History
from tests.big_history import big_history_copy
from tests.conftest import CHROMIUM, db_rows, free_ports, set_run, skip_or_fail
from tests.test_history_faults import PARROT, UNICODE_TEXT

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger(__name__)

if not os.path.exists(CHROMIUM):
    skip_or_fail("Debian's chromium is not installed", module=True)


class Console:
    """launch.py in a process of its own, on one database file."""

    def __init__(self, db: Path, log_path: Path):
        self.db, self.log_path = db, log_path
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> "Console":
        self.port = free_ports(1)[0]
        env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
        with open(self.log_path, "a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "launch.py", "--preset", "smollm2-ngram", "--port", str(self.port), "--db",
                 str(self.db)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                assert self.proc.poll() is None, f"the console exited at start:\n{self.tail()}"
                time.sleep(0.3)
        pytest.fail(f"the console did not come up:\n{self.tail()}")

    def ensure(self) -> "Console":
        return self if self.proc is not None and self.proc.poll() is None else self.start()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    def tail(self) -> str:
        return self.log_path.read_text()[-3000:] if self.log_path.exists() else ""


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    folder = tmp_path_factory.mktemp("console")
    db = folder / "history.db"
    counts = big_history_copy(db)
    c = Console(db, folder / "console.log").start()
    c.counts = counts
    yield c
    c.stop()
    print(c.tail())


@pytest.fixture
def new_page(browser):
    """Opens a page in a browser context of its own (its own gradio session), with the models ready; closes them
    after the test."""
    contexts = []

    def open_page(url: str):
        contexts.append(browser.new_context(viewport={"width": 1500, "height": 1700}))
        page = contexts[-1].new_page()
        page.goto(url)
        page.wait_for_selector("#model-status:has-text('Ready')", timeout=120_000)
        return page

    yield open_page
    for context in contexts:
        context.close()


def click_run(page, timeout_s: float = 30) -> None:
    """Press Run and wait until the panels have let go of the previous run (their status no longer counts tokens)."""
    page.click("#run")
    page.wait_for_function("() => !document.querySelector('#baseline-panel .panel-status').textContent"
                           ".includes('tokens')", timeout=timeout_s * 1000)


def wait_for_run(page, timeout_s: float = 240) -> None:
    for panel in ("#baseline-panel", "#speculative-panel"):
        page.wait_for_selector(f"{panel} .panel-status:has-text('tokens')", timeout=timeout_s * 1000)
    page.wait_for_selector("#figures:has-text('machine during the run')", timeout=60_000)


def panel_text(page, panel: str) -> tuple[int, str]:
    """How many tokens a panel shows and its text (an empty piece shows as a zero-width space: left out)."""
    return page.evaluate(f"""() => [document.querySelectorAll('{panel} .tok').length,
                                     document.querySelector('{panel} .tokens').textContent.replaceAll('\\u200b', '')]""")


def open_history(page) -> None:
    page.get_by_role("tab", name="History").click()
    page.wait_for_selector("#history-table")


def seconds_until(page, action, shows: str) -> float:
    """Seconds from the press that `action` makes to the moment the page's `shows` (a JS expression) is true, on the
    page's own clock: playwright's round trips to the browser are not in it."""
    page.evaluate("""() => { window.pressed = window.shown = null;
        addEventListener('pointerdown', () => { window.pressed = performance.now(); }, {capture: true, once: true});
    }""")
    action()
    page.wait_for_function(f"() => ({shows}) && (window.shown = window.shown || performance.now())", timeout=30_000)
    return page.evaluate("(window.shown - window.pressed) / 1000")


def page_info(text: str) -> str:
    return f"document.querySelector('#history-page-info').textContent.includes({text!r})"


def first_cell(col: int, text: str) -> str:
    return f"document.querySelector(\"#history-table [data-testid='cell-0-{col}']\")?.textContent.trim() === {text!r}"


TRIES = 5  # of each History tab action: their median is held to the 1 s, so that one slow try is not a failure


def test_history_tab_with_10000_runs_opens_and_filters_fast(console, new_page):
    """The issue asks for under a second to open the tab, filter by category and turn a page, with a long history.
    Each is done 5 times, timed in Chromium from the click to the new page on screen, and the median of each must be
    under 1 s: a busy machine slows a try or two, not the median. (The queries behind it are checked for their work,
    whatever the machine, in tests/test_history_faults.py.)"""
    c = console.ensure()
    page = new_page(c.url)
    history = History(c.db)  # the tab must read the file anew: a run more before each opening
    added = []
    runs = db_rows(c.db, "SELECT count(*) FROM runs")[0][0]
    timings = {"open the tab": [], "filter by category": [], "next page": []}
    for i in range(TRIES):
        page.get_by_role("tab", name="Run").click()
        added.append(history.start_run(prompt=f"one more ({i})", category="chat"))
        timings["open the tab"].append(seconds_until(page, lambda: page.get_by_role("tab", name="History").click(),
                                                     page_info(f"· {runs + i + 1:,} runs")))
    assert page.get_attribute("#history-table [role=grid]", "aria-rowcount") == "101"  # a page: 100 rows + header
    assert page.inner_text("#history-table [data-testid='cell-0-0']") == added[-1]  # the newest run first

    categories = ["code", "creative", "json_sql", "summarization", "chat"]  # each differs from the one before
    for category in categories:
        count = db_rows(c.db, "SELECT count(*) FROM runs WHERE category = ?", [category])[0][0]
        page.locator("#history-category input").click()  # the list opens; the choice is timed
        timings["filter by category"].append(seconds_until(
            page, lambda: page.get_by_role("option", name=category, exact=True).click(),
            f"{page_info(f'· {count:,} runs')} && {first_cell(3, category)}"))
    pages = -(-count // 100)
    assert f"page 1 of {pages}" in page.inner_text("#history-page-info")
    for n in range(2, 2 + TRIES):
        timings["next page"].append(seconds_until(page, lambda: page.click("#history-older"),
                                                  page_info(f"page {n} of {pages}")))
    cells = page.locator("#history-table [role=gridcell][data-col='3']").all_inner_texts()  # (the rows in view)
    assert cells and set(c.strip() for c in cells) == {categories[-1]}
    medians = {action: statistics.median(seconds) for action, seconds in timings.items()}
    log.info("History tab over %d runs, in Chromium: %s", runs, "; ".join(
        f"{action} {', '.join(f'{1000 * t:.0f}' for t in seconds)} ms" for action, seconds in timings.items()))
    assert max(medians.values()) < 1.0, medians
    history.delete(added)


# --- text that is not ASCII --------------------------------------------------------------------------------------


def test_unicode_run_renders_from_the_history(console, new_page, smol_tokenizer):
    """Right-to-left, zero-width, emoji split over tokens (one also rejected across drafts) and markup, as SmolLM2's
    tokenizer cuts them, rendered by Chromium from the history: the text is exact and escaped, Hebrew reads right to
    left, and a right-to-left override stays inside its own token."""
    c = console.ensure()
    run = _Recorder("speculative", "ngram", smol_tokenizer, [], StopConditions(400), time.perf_counter)
    for n, i in enumerate(smol_tokenizer.encode(UNICODE_TEXT, add_special_tokens=False)):
        run.commit(TokenKind.ACCEPTED, i, n, 0)
        if n == 1:  # after "Parrot": the emoji drafted and rejected
            for j, p in enumerate(smol_tokenizer.encode(" " + PARROT, add_special_tokens=False)):
                run.reject(p, n, j + 1)
    result = run.finish()
    history = History(c.db)
    run_id = history.start_run(prompt="unicode", category="chat", method="ngram", mode="fair")
    history.finish_run(run_id, "completed", {"speculative": result}, ComparisonFigures())

    page = new_page(c.url)
    open_history(page)
    page.fill("#open-run-id textarea", run_id)
    page.click("#open-run")
    page.wait_for_selector("#history-speculative .tok")
    panel = "#history-speculative .tokens"
    text = page.evaluate(f"() => document.querySelector('{panel}').textContent")
    assert text == "".join(t.text or "\u200b" for t in result.tokens)
    assert "\ufffd" not in text and PARROT in text
    assert page.locator(f"{panel} script").count() == 0 and page.locator(f"{panel} .tok").count() == len(result.tokens)
    rejected = page.locator(f"{panel} del.rejected").all_inner_texts()
    assert [r.replace("\u200b", "") for r in rejected] == ["", "", " " + PARROT]  # once, whole

    boxes = page.evaluate(f"""() => [...document.querySelectorAll('{panel} .tok')].map(s => {{
        const r = s.getBoundingClientRect(); return [s.textContent, r.left, r.right, r.top]; }})""")
    # "שלום": its letters come in order in the tokens ("ל" then "ו"); on screen the later one is further left
    hebrew = [(t, left, right, top) for t, left, right, top in boxes if t in ("ל", "ו")][:2]
    assert [h[0] for h in hebrew] == ["ל", "ו"] and hebrew[1][2] <= hebrew[0][1] + 0.5, hebrew
    # an override that nothing closes would turn the rest of the panel around: it stays inside its token, and
    # " end" still stands right of "evil"
    evil = next(b for b in boxes if "evil" in b[0])
    end = next(b for b in boxes if b[0] == " end")
    assert evil[3] == end[3] and evil[2] <= end[1] + 0.5, (evil, end)
    history.delete([run_id])


# --- two browser tabs --------------------------------------------------------------------------------------------


def test_two_tabs_run_one_after_the_other(console, new_page):
    """Two pages press Run at once: one runs, the other says that it is queued (concurrent runs would share the CPU
    and both timings would be wrong), then runs; both are exact and saved."""
    c = console.ensure()
    pages = [new_page(c.url) for _ in range(2)]
    prompts = ["List the days of the week, one per line. (tab A)", "List five colours, one per line. (tab B)"]
    for page, prompt in zip(pages, prompts):
        set_run(page, prompt, 32)
    for page in pages:
        page.click("#run")  # both at once
    queued = []
    deadline = time.monotonic() + 30
    while not queued and time.monotonic() < deadline:
        queued = [i for i, p in enumerate(pages) if "Queued behind another run" in p.inner_text("#speculative-panel")]
        time.sleep(0.2)
    assert len(queued) == 1, "neither page said that it waits"
    waiting = pages[queued[0]]
    assert "share the CPU" in waiting.inner_text("#figures")
    assert waiting.locator("#baseline-panel .tok").count() == 0  # it has not started
    start = time.monotonic()
    for page in (pages[1 - queued[0]], waiting):
        wait_for_run(page)
        assert "identical to the baseline" in page.inner_text("#figures")
        log.info("a run finished after %.0f s: %s", time.monotonic() - start,
                 page.inner_text("#figures").replace("\n", " ")[:400])
    rows = {prompt: db_rows(c.db, "SELECT id, status, identical, created_at, finished_at FROM runs WHERE prompt = ?",
                            [prompt]) for prompt in prompts}
    assert all(len(r) == 1 and r[0][1:3] == ("completed", 1) for r in rows.values()), rows
    first, second = sorted((r[0] for r in rows.values()), key=lambda r: r[3])
    assert second[3] >= first[4], "the second run started before the first had finished"
    for page, prompt in zip(pages, prompts):  # what each page showed is what was saved
        run_id = rows[prompt][0][0]
        for engine in ("baseline", "speculative"):
            shown, _ = panel_text(page, f"#{engine}-panel")
            saved = db_rows(c.db, "SELECT count(*) FROM tokens WHERE run_id = ? AND engine = ?", [run_id, engine])
            assert saved == [(shown,)], (engine, shown, saved)
    open_history(pages[0])
    pages[0].click("#refresh-history")
    for prompt in prompts:
        pages[0].wait_for_selector(f"#history-table:has-text('{prompt[:30]}')", timeout=30_000)


# --- kill -9 -----------------------------------------------------------------------------------------------------


def _completed_runs(db: Path) -> list[tuple]:
    """Everything about the completed runs, their token events summed up."""
    return db_rows(db, """SELECT r.id, r.status, r.finished_at, (SELECT group_concat(output, '|') FROM engines
                                 WHERE run_id = r.id), r.comparison, t.n, t.ids, t.chars
                          FROM runs r LEFT JOIN (SELECT run_id, count(*) AS n, sum(token_id) AS ids,
                                                        total(length(text)) AS chars FROM tokens GROUP BY run_id) t
                          ON t.run_id = r.id WHERE r.status = 'completed' ORDER BY r.id""")


def test_kill_9_mid_run_keeps_what_it_had_streamed(console, new_page):
    c = console.ensure()
    page = new_page(c.url)
    set_run(page, "Write a long story about a lighthouse keeper and the sea, in many short paragraphs.", 1500)
    before = _completed_runs(c.db)
    page.click("#run")
    page.wait_for_function("() => document.querySelectorAll('#speculative-panel .tok').length >= 20",
                           timeout=120_000)
    time.sleep(1.0)
    seen = {e: panel_text(page, f"#{e}-panel") for e in ("baseline", "speculative")}
    time.sleep(4.0)  # several saves (one a second, each between two passes) after what the page showed
    assert "running" in page.inner_text("#baseline-panel .panel-status"), "the run ended before the kill"
    c.kill()
    (run_id, status), = db_rows(c.db, "SELECT id, status FROM runs WHERE prompt LIKE 'Write a long story%'")
    assert status == "running"  # nothing could mark it: the process died

    c.start()  # the next start, on the same file
    page = new_page(c.url)
    row = db_rows(c.db, "SELECT status, error FROM runs WHERE id = ?", [run_id])[0]
    assert row[0] == "interrupted" and "ended before the run did" in row[1]
    outputs = dict(db_rows(c.db, "SELECT engine, output FROM engines WHERE run_id = ?", [run_id]))
    assert sorted(outputs) == ["baseline", "speculative"]
    for engine, output in outputs.items():
        shown, text = seen[engine]
        saved = db_rows(c.db, "SELECT count(*) FROM tokens WHERE run_id = ? AND engine = ?", [run_id, engine])[0][0]
        assert saved >= shown, f"{engine}: the page showed {shown} tokens, {saved} were saved"
        visible = db_rows(c.db, "SELECT count(*) FROM tokens WHERE run_id = ? AND engine = ? AND kind != 'rejected'",
                          [run_id, engine])[0][0]
        assert output and visible, engine
        if engine == "baseline":  # (the speculative panel also shows rejected drafts)
            assert output.startswith(text), (output[:200], text[:200])
    assert db_rows(c.db, "PRAGMA integrity_check") == [("ok",)]
    assert _completed_runs(c.db) == before  # every completed run is intact

    open_history(page)
    page.click("#refresh-history")
    page.wait_for_selector("#history-table [data-testid='cell-0-2']:has-text('interrupted')", timeout=30_000)
    page.fill("#open-run-id textarea", run_id)
    page.click("#open-run")
    page.wait_for_selector("#history-baseline .tok")
    assert page.locator("#history-baseline .tok").count() >= seen["baseline"][0]
    assert "interrupted" in page.inner_text("#history-run-info")


# --- the engine process ------------------------------------------------------------------------------------------


def engine_process(console_pid: int):
    """The console's engine process (engine.process.child), once it is there."""
    import psutil

    for _ in range(600):
        found = [p for p in psutil.Process(console_pid).children()
                 if "engine.process.child" in " ".join(p.cmdline())]
        if found:
            return found[0]
        time.sleep(0.1)
    pytest.fail("the console started no engine process")


def test_a_killed_engine_process_fails_the_run_in_the_page_and_the_next_run_gets_a_fresh_one(console, new_page):
    """kill -9 of the engine process (as the kernel's OOM killer would) mid-run: the page stays up, says why the run
    ended and keeps what it had streamed; the run is saved as failed with the reason; the next Run is served by a
    fresh engine process."""
    c = console.ensure()
    page = new_page(c.url)
    set_run(page, "Write a long story about a lighthouse keeper and the sea, in many short paragraphs.", 1500)
    engines = engine_process(c.proc.pid)
    assert engines.pid != c.proc.pid  # the console serves the page; the passes run there
    page.click("#run")
    page.wait_for_function("() => document.querySelectorAll('#baseline-panel .tok').length >= 20", timeout=120_000)
    os.kill(engines.pid, signal.SIGKILL)
    page.wait_for_selector("#baseline-panel .panel-error:has-text('killed by SIGKILL')", timeout=60_000)
    shown, text = panel_text(page, "#baseline-panel")
    assert shown >= 20 and text  # what it had streamed stays on screen
    page.wait_for_selector("#speculative-panel .panel-error:has-text('killed by SIGKILL')", timeout=60_000)
    for _ in range(300):  # the run is saved once both engines have ended
        (run_id, status, error), = db_rows(c.db, "SELECT id, status, error FROM runs WHERE prompt LIKE 'Write a long "
                                                 "story%' ORDER BY created_at DESC LIMIT 1")
        if status != "running":
            break
        time.sleep(0.1)
    assert status == "failed" and "killed by SIGKILL" in error
    saved = db_rows(c.db, "SELECT count(*) FROM tokens WHERE run_id = ? AND engine = 'baseline'", [run_id])[0][0]
    assert saved >= 20

    set_run(page, "Name three colours.", 16)
    click_run(page, timeout_s=120)  # this Run first starts a fresh engine process, which loads the models
    wait_for_run(page)
    fresh = engine_process(c.proc.pid)
    assert fresh.pid != engines.pid and "identical" in page.inner_text("#figures")


def test_the_engine_process_ends_with_the_console(tmp_path):
    """The console's SIGTERM stops its engine process; so does a kill -9 of the console (the pipe's end-of-file)."""
    import psutil

    for how in (signal.SIGTERM, signal.SIGKILL):
        c = Console(tmp_path / f"{how.name}.db", tmp_path / f"{how.name}.log").start()
        engines = engine_process(c.proc.pid)
        os.kill(c.proc.pid, how)
        c.proc.wait(60)
        try:
            engines.wait(30)
        except psutil.TimeoutExpired:
            engines.kill()
            pytest.fail(f"the engine process outlived the console's {how.name}:\n{c.tail()}")


def test_two_consoles_on_one_history_file_each_run_their_own_engines(tmp_path):
    """A second console on the same history file: each has an engine process of its own, and both save their runs."""
    from gradio_client import Client

    db = tmp_path / "history.db"
    consoles = [Console(db, tmp_path / f"console-{i}.log").start() for i in range(2)]
    try:
        pids = [engine_process(c.proc.pid).pid for c in consoles]
        assert len(set(pids)) == 2
        for c in consoles:
            deadline = time.monotonic() + 120
            while "models ready" not in c.tail() and time.monotonic() < deadline:
                time.sleep(0.5)
            job = Client(c.url, verbose=False).submit("Name three colours.", None, "ngram", 3, False, 0.0, 0, False, 0.0, 1.0, 12, 0,
                                "fair", True, [], api_name="/run")
            list(job)
        rows = db_rows(db, "SELECT r.status, e.metrics FROM runs r JOIN engines e ON e.run_id = r.id AND "
                           "e.engine = 'baseline' WHERE r.prompt = 'Name three colours.'")
        assert [r[0] for r in rows] == ["completed", "completed"]
        assert sorted(json.loads(r[1])["engine_pid"] for r in rows) == sorted(pids)
    finally:
        for c in consoles:
            c.stop()


# --- a full disk -------------------------------------------------------------------------------------------------


class FullDisk:
    """The console in this process, so that the test holds its History: PRAGMA max_page_count on the console's own
    connection stops the file from growing (SQLITE_FULL, "database or disk is full", as on a full disk) and lets it
    grow again. Needs no privilege, so it runs everywhere."""

    def __init__(self, db: Path):
        from specconsole import cli
        from specconsole.app import launch as serve

        parser = argparse.ArgumentParser()
        cli.add_engine_args(parser)
        self.db, self.port = db, free_ports(1)[0]
        self.history = History(db)
        self.host = backends.local_host(parser.parse_args(["--preset", "smollm2-ngram"])).start()
        self.app = serve(self.host, self.history, "127.0.0.1", self.port, prevent_thread_lock=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def fill(self) -> None:
        """No page more than the file has now."""
        with self.history.lock:  # between two of the console's writes
            pages = self.history.db.execute("PRAGMA page_count").fetchone()[0]
            self.history.db.execute(f"PRAGMA max_page_count = {pages}")

    def free(self) -> None:
        with self.history.lock:
            self.history.db.execute("PRAGMA max_page_count = 1073741823")

    def stop(self) -> None:
        self.app.close()
        self.host.close()


def test_disk_full_mid_run_keeps_serving(new_page, tmp_path):
    c = FullDisk(tmp_path / "history.db")
    try:
        page = new_page(c.url)
        set_run(page, "Name three rivers.", 16)
        click_run(page)
        wait_for_run(page)
        ((first,),) = db_rows(c.db, "SELECT id FROM runs")
        before = db_rows(c.db, "SELECT * FROM tokens ORDER BY engine, seq")

        set_run(page, "Write a long poem about rivers, many verses.", 64)
        click_run(page)
        page.wait_for_function("() => document.querySelectorAll('#baseline-panel .tok').length >= 10",
                               timeout=120_000)
        c.fill()
        wait_for_run(page)
        figures = page.inner_text("#figures")
        assert "Not saved in the history" in figures and "database or disk is full" in figures, figures
        page.wait_for_selector("[data-testid='toast-body']:has-text('Not saved in the history')", timeout=30_000)
        for engine in ("baseline", "speculative"):  # the whole run is on screen
            assert page.locator(f"#{engine}-panel .panel-status").inner_text().startswith(("length · 64", "eos"))
        shown, _ = panel_text(page, "#baseline-panel")
        assert shown >= 10

        c.free()  # room again: the console goes on saving
        set_run(page, "Name three lakes.", 16)
        click_run(page)
        wait_for_run(page)
        assert "Not saved" not in page.inner_text("#figures")
        runs = dict(db_rows(c.db, "SELECT status, count(*) FROM runs GROUP BY status"))
        assert runs == {"completed": 2, "interrupted": 1}, runs
        (error,) = db_rows(c.db, "SELECT error FROM runs WHERE status = 'interrupted'")[0]
        assert "database or disk is full" in error
        assert db_rows(c.db, "SELECT * FROM tokens WHERE run_id = ? ORDER BY engine, seq", [first]) == before
        assert db_rows(c.db, "PRAGMA integrity_check") == [("ok",)]
        open_history(page)
        page.click("#refresh-history")
        page.wait_for_selector("#history-table:has-text('interrupted')", timeout=30_000)
    finally:
        c.stop()
