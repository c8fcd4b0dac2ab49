"""Files and markup from untrusted input: export names from page input, Markdown / HTML from a shared or edited
history file, and the folder the exports go to. Each test calls what the page's callbacks call, on a real SQLite
history in tmp_path."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from engine.events import RunResult, TokenEvent, TokenKind
from engine.comparison import ComparisonFigures
from engine.run_metrics import RunMetrics
from specconsole.advisor import advise
from specconsole.history import History
from specconsole.suites import PROMPTS_DIR, load_suite, suite_items
from specconsole.workbench import ab_compare, aggregate, runs_frame
from tests.conftest import CHROMIUM, free_ports, launch_chromium

IMG_MD = "![x](http://evil/x.png)"
IMG_HTML = "<img src=x onerror=alert(1)>"
HOSTILE = f"{IMG_MD} {IMG_HTML}"


def save_run(history: History, suite_id: str | None = None, category: str = "code", prompt: str = "def f():",
             speedup: float = 1.5, extra: bool = False) -> str:
    """A finished run as the runner saves one (no engine needed: the figures are given)."""
    engines = None
    if extra:
        engines = [{"engine": e, "label": e, "method": m} for e, m in
                   (("baseline", "none"), ("speculative", "draft"), ("speculative-2", "ngram"))]
    run_id = history.start_run(engines=engines, category=category, prompt=prompt, method="draft", mode="fair",
                               settings={}, suite_id=suite_id, repeat=0)
    results = {}
    for engine, method, tps in (("baseline", "none", 10.0), ("speculative", "draft", 10.0 * speedup),
                                ("speculative-2", "ngram", 12.0))[: 3 if extra else 2]:
        r = RunResult(engine, method, 3, output_text="ab", finish_reason="length")
        r.tokens = [TokenEvent(TokenKind.BASELINE if engine == "baseline" else TokenKind.ACCEPTED, 7, t, 1, i, 0.1 * i,
                               i) for i, t in enumerate("ab")]
        r.metrics = RunMetrics(tokens_per_s=tps, output_tokens=2, acceptance_rate=0.5, mean_accepted_length=1.5)
        results[engine] = r
    comparisons = {"speculative-2": ComparisonFigures(identical=True, speedup=1.2)} if extra else None
    history.finish_run(run_id, "completed", results, ComparisonFigures(speedup=speedup, identical=True),
                       comparisons=comparisons)
    return run_id


def tamper(history: History, sql: str, args: list) -> None:
    """Edit the file behind the console's back, as a shared or hand-edited history would be."""
    conn = sqlite3.connect(history.path)
    with conn:
        conn.execute(sql, args)
    conn.close()


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def rendered(markdown: str) -> str:
    """The HTML a CommonMark renderer (raw HTML allowed, as in Gradio's Markdown) makes of the text."""
    return MarkdownIt("commonmark").enable(["strikethrough", "table"]).render(markdown)


def assert_inert_markdown(markdown: str) -> None:
    html = rendered(markdown)
    assert "<img" not in html and "<a " not in html, html


# --- 1. names from page input ------------------------------------------------------------------------------------


def test_traversal_suite_id_writes_nothing_and_says_why(tmp_path, backend):
    from specconsole.export import ExportFolder
    from specconsole.suite_job import export_suite_files

    history = History(tmp_path / "h.db")
    save_run(history, suite_id="abc123")
    victim = tmp_path / "home" / "u"
    folder = ExportFolder(tmp_path / "tmp")
    hostile = "/../../../../../../../.." + str(victim / "notes")
    for suite_id in (hostile, "../notes", "nosuchsuite", ""):
        with pytest.raises(ValueError, match="no suite"):
            export_suite_files(history, backend, suite_id, folder)
    assert not victim.exists() and files_under(tmp_path / "tmp") == []
    # a known suite exports under fixed names in the export folder, nowhere else
    paths = export_suite_files(history, backend, " abc123 ", folder).paths
    assert [p.name for p in paths] == ["suite_abc123.csv", "suite_abc123_categories.csv", "suite_abc123.html"]
    assert all(p.parent == folder.root() / "suite" for p in paths)


def test_stored_suite_id_that_cannot_name_a_file_is_refused(tmp_path, backend):
    from specconsole.export import ExportFolder
    from specconsole.suite_job import export_suite_files

    history = History(tmp_path / "h.db")
    run_id = save_run(history, suite_id="ok")
    tamper(history, "UPDATE runs SET suite_id = ? WHERE id = ?", ["../../../escape", run_id])
    folder = ExportFolder(tmp_path / "tmp")
    with pytest.raises(ValueError, match="cannot name a file"):
        export_suite_files(history, backend, "../../../escape", folder)
    assert [p.name for p in files_under(tmp_path) if not p.name.startswith("h.db")] == []


def test_export_suite_refuses_an_unknown_suite_before_writing(tmp_path, backend):
    from specconsole.suite_job import export_suite

    history = History(tmp_path / "h.db")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="no suite 'missing'"):
        export_suite(history, backend, "missing", out / "suite.csv", out / "suite.html")
    assert not out.exists()


def test_unknown_category_names_are_refused(tmp_path):
    # a category name that walks out of assets/prompts to a JSONL file of the attacker's choosing
    (tmp_path / "evil.jsonl").write_text(json.dumps({"prompt": "read from outside"}) + "\n")
    walk = os.path.relpath(tmp_path / "evil", PROMPTS_DIR)
    for name in (walk, "../prompts/code", "code/../code", ""):
        with pytest.raises(ValueError, match="no prompt suite"):
            load_suite(name)
        with pytest.raises(ValueError, match="no prompt suite"):
            suite_items(name, 2)
    assert load_suite("code")  # the known names still load


def test_selected_runs_must_exist_before_anything_is_exported(tmp_path):
    from specconsole.export import ExportFolder
    from specconsole.tab_history import export_replays, export_runs

    history = History(tmp_path / "h.db")
    known = save_run(history)
    folder = ExportFolder(tmp_path / "tmp")
    for selected in ("../../x", f"{known},nosuch", "<img src=x>"):
        with pytest.raises(ValueError, match="no run"):
            export_runs(history, selected, False, folder)
        with pytest.raises(ValueError, match="no run"):
            export_replays(history, selected, folder)
    with pytest.raises(ValueError, match="Select runs"):
        export_runs(history, " , ", False, folder)
    assert files_under(tmp_path / "tmp") == []
    assert [p.name for p in export_replays(history, known, folder)] == [f"replay-{known}.html"]


def test_stored_run_id_that_cannot_name_a_file_gets_no_replay(tmp_path):
    from specconsole.export import ExportFolder
    from specconsole.tab_history import export_replays

    history = History(tmp_path / "h.db")
    run_id = save_run(history)
    for table in ("tokens", "engines"):
        tamper(history, f"UPDATE {table} SET run_id = ? WHERE run_id = ?", ["../../escape", run_id])
    tamper(history, "UPDATE runs SET id = ? WHERE id = ?", ["../../escape", run_id])
    with pytest.raises(ValueError, match="cannot name a file"):
        export_replays(history, "../../escape", ExportFolder(tmp_path / "tmp" / "a"))
    assert not (tmp_path / "escape.html").exists() and files_under(tmp_path / "tmp") == []


# --- 6. markup from data -----------------------------------------------------------------------------------------


def test_opened_run_shows_prompt_error_and_category_as_text(tmp_path):
    from specconsole.tab_history import run_info

    history = History(tmp_path / "h.db")
    run_id = save_run(history, category=HOSTILE, prompt=f"Describe this: {HOSTILE}\n# heading\n- item")
    tamper(history, "UPDATE runs SET error = ?, method = ?, status = ? WHERE id = ?",
           [HOSTILE, IMG_MD, IMG_HTML, run_id])
    info = run_info(history.run(run_id))
    assert_inert_markdown(info)
    html = rendered(info)
    assert html.count(IMG_MD) >= 3  # prompt, category, error and method read as the text they are
    assert "&lt;img src=x onerror=alert(1)&gt;" in html and "<h1>" not in html and "<li>" not in html


def test_history_figures_that_are_not_numbers_render_as_text(tmp_path):
    from specconsole.tab_history import view

    history = History(tmp_path / "h.db")
    run_id = save_run(history, extra=True)
    row = history.run(run_id)
    comparison = json.loads(row["comparison"]) | {"identical": False, "first_divergence": IMG_HTML,
                                                  "nll_baseline": IMG_HTML, "nll_speculative": 1.0,
                                                  "perplexity_baseline": 1.0, "perplexity_speculative": IMG_MD,
                                                  "sampling_check": "ok", "noisy": False, "other_cores": IMG_HTML}
    metrics = history.engines(run_id)["speculative"]["metrics"] | {
        "tree_accepted": IMG_HTML, "fallback_count": IMG_HTML, "passes_saved": IMG_HTML, "output_tokens": IMG_HTML,
        "tokens_per_s": IMG_HTML, "vllm_time_to_first_token_ms": 1.0, "provisional_accuracy": IMG_HTML}
    tamper(history, "UPDATE runs SET comparison = ? WHERE id = ?", [json.dumps(comparison), run_id])
    tamper(history, "UPDATE engines SET metrics = ? WHERE run_id = ? AND engine = 'speculative'",
           [json.dumps(metrics | {"server_counters": IMG_HTML}), run_id])
    tamper(history, "UPDATE engines SET comparison = ? WHERE run_id = ? AND engine = 'speculative-2'",
           [json.dumps({"identical": False, "first_divergence": IMG_HTML, "speedup": IMG_HTML}), run_id])
    tamper(history, "UPDATE tokens SET p = ?, q = ? WHERE run_id = ?", [IMG_HTML, IMG_HTML, run_id])

    row = history.run(run_id)
    baseline, speculative, figures = view(history.results(run_id), json.loads(row["comparison"]), "fair", True,
                                          history.engines(run_id))
    for html in (baseline, speculative, figures):
        assert "<img" not in html and "onerror=alert(1)>" not in html
    assert "first divergence at token ?" in figures and "diverges at token ?" in figures
    assert '<div class="fig-value">?</div>' in figures  # the tree and fallback figures


def test_history_table_survives_figures_that_are_not_numbers(tmp_path):
    from specconsole.tab_history import history_rows

    history = History(tmp_path / "h.db")
    run_id = save_run(history)
    tamper(history, "UPDATE runs SET speedup = ?, acceptance_rate = ? WHERE id = ?", ["x", IMG_HTML, run_id])
    table, page, where = history_rows(history, "all")
    assert page == 1 and "1 run" in where
    assert table.loc[0, "speedup"] is None and table.loc[0, "acceptance"] is None, table.iloc[0].to_dict()


def test_chart_labels_from_data_are_text_for_plotly():
    """plotly renders <a href>, <b> and styles in trace names and axis labels: labels from data go in escaped."""
    import pandas as pd

    from engine.events import RunResult
    from specconsole import charts, report

    link = '<a href="http://evil/">x</a>'
    run = RunResult(engine="speculative-2", method="draft", prompt_tokens=1)
    figs = [charts.acceptance_per_step(None, {link: run}), charts.per_position(None, {link: run}),
            charts.tokens_over_time(None, None, {link: run}), charts.time_per_pass(None, None, {link: run}),
            report.speedup_chart(pd.DataFrame([{"category": link, "sweep_value": "", "speedup": 1.2,
                                                "speedup_low": 1.0, "speedup_high": 1.4, "machine_bound": 2.0}])),
            report.ab_chart(pd.DataFrame(), link, link)]
    text = "".join(f.to_json() for f in figs)
    assert "<a href" not in text and "&lt;a href" in text


def test_advice_and_ab_lines_show_hostile_categories_as_text(tmp_path):
    from specconsole.tab_workbench import ab_markdown

    history = History(tmp_path / "h.db")
    for speedup in (1.4, 1.5, 1.6):
        save_run(history, suite_id="s1", category=HOSTILE, prompt=f"p{speedup}", speedup=speedup)
    runs = runs_frame(history, "s1")
    tamper(history, "UPDATE runs SET sweep_value = ?", [IMG_MD])
    swept = runs_frame(history, "s1")
    [advice] = advise(aggregate(runs))
    [swept_advice] = advise(aggregate(swept), "k", IMG_MD)
    for markdown in (advice.markdown(), swept_advice.markdown(), ab_markdown(ab_compare(runs, swept))):
        assert_inert_markdown(markdown)
        assert IMG_MD in rendered(markdown)
    assert advice.text().startswith(f"{HOSTILE}: ")  # the terminal gets the plain text


def test_markup_helpers_take_only_text_and_numbers():
    from specconsole.markup import md, number

    assert number(1.234, ".2f", "×") == "1.23×" and number(None) == "–" and number(3) == "3"
    for bad in (IMG_HTML, "1.5", True, [1], {"a": 1}):
        assert number(bad, ".2f") == "?"
    assert number(float("nan"), ".2f") == "nan"
    assert_inert_markdown(md(f"{HOSTILE} www.evil.com `x` **b** <http://evil> [l]: http://evil"))
    assert rendered(md("1. a\n# b")).strip() == "<p>1. a # b</p>"


# --- 7. one export folder per process ----------------------------------------------------------------------------


def test_repeated_exports_leave_one_folder_with_the_latest_files(tmp_path, backend):
    from specconsole.export import ExportFolder
    from specconsole.suite_job import export_suite_files
    from specconsole.tab_history import export_replays, export_runs

    history = History(tmp_path / "h.db")
    first, second = save_run(history, suite_id="s1"), save_run(history, suite_id="s2")
    base = tmp_path / "tmp"
    folder = ExportFolder(base)
    for _ in range(4):
        everything = export_runs(history, "", True, folder)
        selected = export_runs(history, first, False, folder)
        export_suite_files(history, backend, "s1", folder)
    export_replays(history, f"{first},{second}", folder)
    replays = export_replays(history, second, folder)  # the previous export's replays are replaced
    suite = export_suite_files(history, backend, "s2", folder).paths
    assert len(list(base.iterdir())) == 1
    root = folder.root()
    assert root.parent == base and str(os.getpid()) in root.name
    assert files_under(root) == sorted([*everything, *selected, *replays, *suite])
    assert [p.name for p in replays] == [f"replay-{second}.html"]
    assert "s1" not in " ".join(p.name for p in files_under(root / "suite"))


def test_the_process_folder_is_under_the_temp_dir_and_goes_at_exit(tmp_path):
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO)\n"
            "from specconsole.export import EXPORTS\n"
            "path = EXPORTS.fresh('runs'); (path / 'x.csv').write_text('x'); print(EXPORTS.root())\n")
    env = os.environ | {"TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent, env=env,
                          capture_output=True, text=True, check=True)
    root = Path(done.stdout.strip())
    assert root.parent == tmp_path and root.name.startswith("specconsole-")
    assert str(root) in done.stderr  # logged where the files go
    assert not root.exists() and list(tmp_path.iterdir()) == []


def test_the_page_bounds_gradios_copies_and_serialises_each_export(tmp_path):
    from specconsole.app import build
    from specconsole.host import ModelHost

    app = build(ModelHost("not loaded", lambda p: None), History(tmp_path / "h.db"))
    assert app.delete_cache is not None
    exports = [fn for fn in app.fns.values() if fn.name in ("export", "export_selected", "export_everything",
                                                             "replays")]
    assert len(exports) == 4 and all(fn.concurrency_limit == 1 for fn in exports)


# --- the same in the page: Gradio's Markdown and toasts in a real browser ----------------------------------------


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")
def test_page_shows_a_hostile_history_as_text_and_loads_nothing(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    from specconsole.app import launch
    from specconsole.host import ModelHost

    history = History(tmp_path / "h.db")
    run_id = save_run(history, category=HOSTILE, prompt=f"Describe: {HOSTILE}")
    tamper(history, "UPDATE runs SET error = ?, comparison = ? WHERE id = ?",
           [HOSTILE, json.dumps({"identical": False, "first_divergence": IMG_HTML, "speedup": 1.5}), run_id])
    port = free_ports(1)[0]
    app = launch(ModelHost("nothing", lambda progress: None), history, "127.0.0.1", port, prevent_thread_lock=True)
    try:
        with sync_playwright() as pw:
            browser = launch_chromium(pw)
            page = browser.new_page()
            asked = []
            page.on("request", lambda r: asked.append(r.url))
            page.goto(f"http://127.0.0.1:{port}/")
            page.get_by_role("tab", name="History").click()
            page.click("#refresh-history")
            expect(page.locator("#history-table")).to_contain_text("evil", timeout=30_000)  # the prompt, as text
            page.fill("#open-run-id textarea", run_id)
            page.click("#open-run")
            info = page.locator("#history-run-info")
            expect(info).to_contain_text("Describe", timeout=30_000)
            expect(page.locator("#history-figures")).to_contain_text("first divergence at token")
            assert page.locator("#history-run-info img, #history-figures img").count() == 0
            assert IMG_MD in info.inner_text() and IMG_HTML in info.inner_text()
            assert "first divergence at token ?" in page.inner_text("#history-figures")
            # a hostile id typed into the selection: the warning shows it as text
            page.fill("#selected-runs textarea", "<img src=http://evil/toast.png>")
            page.click("#export-replay")
            expect(page.get_by_text("<img src=http://evil/toast.png>", exact=False).first).to_be_visible(
                timeout=30_000)
            assert page.locator("img[src*='evil'], #history-table img, #history-run-info img, #history-figures img"
                                ).count() == 0
            assert [u for u in asked if "evil" in u] == []
            # the known run exports, from the process's one folder
            page.fill("#selected-runs textarea", run_id)
            page.click("#export-replay")
            page.locator(f"#export-files a[download='replay-{run_id}.html']").wait_for(timeout=30_000)
            page.click("#export-all")
            page.locator("#export-files a[download='specconsole_runs.csv']").wait_for(timeout=30_000)
            expect(page.get_by_text("replaced by the next export").first).to_be_visible()
            # the Workbench's suite id box with a path in it: a warning, and no file anywhere
            victim = tmp_path / "home" / "u"
            page.get_by_role("tab", name="Workbench").click()
            page.fill("#suite-id textarea", "/../../../../../../../.." + str(victim / "notes"))
            page.click("#export-suite")
            expect(page.get_by_text("in the history or this console's sweeps").first).to_be_visible(timeout=30_000)
            assert not victim.exists() and page.locator("#suite-files a").count() == 0
            browser.close()
    finally:
        app.close()
