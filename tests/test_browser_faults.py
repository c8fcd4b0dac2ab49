"""Faults with the real parts: Debian's Chromium (playwright) drives the real console, a process of its own with the
SmolLM2 n-gram preset, on a real SQLite file that starts with a long history (10,000 runs, tests/big_history.py).
One console serves the module; the kill test kills it and starts it again on the same file; the full-disk test runs
a second console on a small tmpfs of its own (skipped where mounting one is not allowed)."""

import contextlib
import errno
import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.events import TokenKind
from engine.local import _Recorder
from engine.stops import StopConditions
from specconsole.history import History
from tests.big_history import big_history_copy
from tests.conftest import CHROMIUM, free_ports, launch_chromium, set_run
from tests.test_history_faults import PARROT, UNICODE_TEXT

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger(__name__)

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")


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


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = launch_chromium(pw)
        yield b
        b.close()


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


def click_run(page) -> None:
    """Press Run and wait until the panels have let go of the previous run (their status no longer counts tokens)."""
    page.click("#run")
    page.wait_for_function("() => !document.querySelector('#baseline-panel .panel-status').textContent"
                           ".includes('tokens')", timeout=30_000)


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


def db_rows(db: Path, sql: str, args=()) -> list[tuple]:
    conn = sqlite3.connect(db, timeout=30)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def seconds_until(page, action, selector: str, timeout_s: float = 30) -> float:
    start = time.perf_counter()
    action()
    page.wait_for_selector(selector, timeout=timeout_s * 1000)
    return time.perf_counter() - start


# --- a long history ----------------------------------------------------------------------------------------------


def test_history_tab_with_10000_runs_opens_and_filters_fast(console, new_page):
    """The issue asks for under a second; the times are measured in the browser and logged, and the assertion is a
    generous 5 s so that a slow or busy CI machine cannot fail it falsely (our rules allow no tighter timing)."""
    c = console.ensure()
    page = new_page(c.url)
    extra = History(c.db).start_run(prompt="one more", category="chat")  # the tab must read the file anew
    runs = db_rows(c.db, "SELECT count(*) FROM runs")[0][0]
    code = db_rows(c.db, "SELECT count(*) FROM runs WHERE category = 'code'")[0][0]
    timings = {
        "open the tab": seconds_until(page, lambda: page.get_by_role("tab", name="History").click(),
                                      f"#history-page-info:has-text('{runs:,} runs')"),
    }
    assert page.get_attribute("#history-table [role=grid]", "aria-rowcount") == "101"  # a page: 100 rows + header
    assert page.inner_text("#history-table [data-testid='cell-0-0']") == extra  # the newest run first

    def pick_code():
        page.locator("#history-category input").click()
        page.get_by_role("option", name="code", exact=True).click()

    timings["filter by category"] = seconds_until(page, pick_code, f"#history-page-info:has-text('· {code:,} runs')")
    pages = -(-code // 100)
    assert f"page 1 of {pages}" in page.inner_text("#history-page-info")
    timings["next page"] = seconds_until(page, lambda: page.click("#history-older"),
                                         f"#history-page-info:has-text('page 2 of {pages}')")
    cells = page.locator("#history-table [role=gridcell][data-col='3']").all_inner_texts()  # (the rows in view)
    assert cells and set(c.strip() for c in cells) == {"code"}
    page.get_by_role("tab", name="Run").click()
    another = History(c.db).start_run(prompt="and one more", category="code")
    timings["open the tab again"] = seconds_until(page, lambda: page.get_by_role("tab", name="History").click(),
                                                  f"#history-page-info:has-text('· {code + 1:,} runs')")
    log.info("History tab over %d runs, in Chromium: %s", runs,
             ", ".join(f"{k} {1000 * v:.0f} ms" for k, v in timings.items()))
    assert max(timings.values()) < 5.0, timings
    History(c.db).delete([extra, another])


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
    history.finish_run(run_id, "completed", {"speculative": result}, {})

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
    return db_rows(db, """SELECT r.id, r.status, r.finished_at, r.baseline_output, r.speculative_output, r.comparison,
                                 t.n, t.ids, t.chars
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
    row = db_rows(c.db, "SELECT status, error, baseline_output, speculative_output FROM runs WHERE id = ?", [run_id])[0]
    assert row[0] == "interrupted" and "ended before the run did" in row[1]
    for engine, output in (("baseline", row[2]), ("speculative", row[3])):
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


# --- a full disk -------------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB filesystem (tmpfs), for a disk that fills up. Mounting needs root (CAP_SYS_ADMIN)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True,
                          text=True, timeout=20)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()}); "
                    "test_history_faults.py fills the database with PRAGMA max_page_count instead")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False, timeout=20)


def fill(disk: Path) -> Path:
    """Write zeros until the filesystem says it is full (ENOSPC)."""
    filler = disk / "filler"
    with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            while True:  # the last, partial block
                f.write(b"\0" * 512)
    return filler


def test_disk_full_mid_run_keeps_serving(small_disk, new_page, tmp_path):
    c = Console(small_disk / "history.db", tmp_path / "console.log").start()
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
        filler = fill(small_disk)
        wait_for_run(page)
        figures = page.inner_text("#figures")
        assert "Not saved in the history" in figures and "database or disk is full" in figures, figures
        page.wait_for_selector("[data-testid='toast-body']:has-text('Not saved in the history')", timeout=30_000)
        for engine in ("baseline", "speculative"):  # the whole run is on screen
            assert page.locator(f"#{engine}-panel .panel-status").inner_text().startswith(("length · 64", "eos"))
        shown, _ = panel_text(page, "#baseline-panel")
        assert shown >= 10

        filler.unlink()  # room again: the console goes on saving
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
