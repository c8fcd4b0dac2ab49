"""The History tab: saved runs a page at a time, one run rebuilt into panels and charts, delete, CSV export."""

from __future__ import annotations

import json
import logging
from html import escape
from pathlib import Path

import gradio as gr
import pandas as pd

from engine.comparison import ComparisonFigures
from specconsole.columns import LIST
from specconsole.export import EXPORTS, ExportFolder, export_all as export_csv_files, file_id
from specconsole.replay import UnknownRun, write_replay
from specconsole.history import History, HistoryError
from specconsole.markup import md
from specconsole.render import engines_html, figures_html, tokens_html
from specconsole.run_stream import figures_for, panel_status, rolling_acceptance
from specconsole.suites import categories

HISTORY_COLUMNS = [c.header for c in LIST]
HISTORY_PAGE = 100  # runs per page of the History tab: a long history is read a page at a time

log = logging.getLogger(__name__)


def _ids(selected: str | None) -> list[str]:
    return [i.strip() for i in (selected or "").split(",") if i.strip()]


def _known(history: History, selected: str | None, what: str) -> list[str]:
    """The selected run ids, all of them in the history; ValueError naming the others (nothing is exported)."""
    ids = list(dict.fromkeys(_ids(selected)))
    if not ids:
        raise ValueError(f"Select runs in the table first (click a row){what}.")
    unknown = [i for i in ids if history.run(i) is None]
    if unknown:
        shown = ", ".join(repr(i[:40]) for i in unknown[:5]) + (" …" if len(unknown) > 5 else "")
        raise ValueError(f"no run {shown} in the history: nothing was exported")
    return ids


def export_runs(history: History, selected: str | None, everything: bool,
                folder: ExportFolder = EXPORTS) -> list[Path]:
    """The runs, tokens and engines CSVs of the selected runs (or of every run) in the folder's "selected" (or
    "runs") subfolder, replacing the last such export. ValueError for a selection of unknown runs."""
    ids = None if everything else _known(history, selected, ", or export the whole history")
    out = folder.fresh("runs" if everything else "selected")
    paths = list(export_csv_files(history, out, ids))
    log.info("%s exported to %s", "the history" if everything else f"{len(ids)} run(s)", out)
    return paths


def export_replays(history: History, selected: str | None, folder: ExportFolder = EXPORTS) -> list[Path]:
    """One self-contained HTML replay per selected run (replay-<id>.html) in the folder's "replays" subfolder,
    replacing the last such export. ValueError for unknown runs or an id that cannot name a file."""
    ids = [file_id(i, "run") for i in _known(history, selected, ": each becomes one replay file")]
    out = folder.fresh("replays")
    paths = [write_replay(history, run_id, out / f"replay-{run_id}.html") for run_id in ids]
    log.info("%d replay(s) exported to %s", len(paths), out)
    return paths


def run_info(row: dict) -> str:
    """The Markdown line above an opened run: status, date, category, method, mode, error, and the prompt's start."""
    return (f"**{md(row['status'])}** · {md(row['created_at'] or '')} · {md(row['category'] or '')} · "
            f"method {md(row['method'] or '')} · mode {md(row['mode'] or '')}"
            + (f" · error: {md(row['error'])}" if row["error"] else "")
            + f"\n\n> {md((row['prompt'] or '')[:300])}")


def view(results: dict, comparison: dict, mode: str, show_rejected: bool, saved: dict | None = None):
    """HTML of both panels and the figures, from the RunResults rebuilt from the history and the run's saved
    comparison column (its figures, and the machine's load and the sampling check beside them). An N-way run's
    extra engines (`saved`: History.engines) follow the figures: the engines table, then a panel each."""
    b, s = results.get("baseline"), results.get("speculative")
    panels = []
    for r, engine in ((b, "baseline"), (s, "speculative")):
        if r is None:
            panels.append(tokens_html([], status="no data"))
            continue
        panels.append(tokens_html(r.tokens, show_rejected and engine == "speculative", r.error, panel_status(r)))
    main = ComparisonFigures.from_dict(comparison)
    figures = figures_html(b, s, main, mode, rolling_acceptance(s) if s else None, comparison)
    extra = [e for e in results if e not in ("baseline", "speculative")]
    if extra:
        saved = saved or {}
        labels = {e: (saved.get(e) or {}).get("label") or e for e in results}
        comparisons = {"speculative": main} | {e: ComparisonFigures.from_dict((saved.get(e) or {}).get("comparison"))
                                               for e in extra}
        figures += engines_html(results, labels, comparisons, mode)
        for e in extra:
            r = results[e]
            figures += (f'<div class="history-extra" data-engine="{escape(e, quote=True)}"><b>{escape(labels[e])}'
                        f'</b> — {escape(e)}{tokens_html(r.tokens, show_rejected, r.error, panel_status(r))}</div>')
    return panels[0], panels[1], figures


def history_rows(history: History, category, page=1) -> tuple[pd.DataFrame, int, str]:
    """One page of the history: the table, the page number (kept in range) and the line that says where it is."""
    rows, total, page = history.page(category if category and category != "all" else None, int(page or 1),
                                     HISTORY_PAGE)
    pages = max(1, -(-total // HISTORY_PAGE))
    where = f"page {page} of {pages} · {total:,} run{'s' if total != 1 else ''}"
    return pd.DataFrame(
        [[c.cell(r.get(c.key)) for c in LIST] for r in rows],
        columns=HISTORY_COLUMNS,
    ), page, where


def build(history: History, tab: gr.Tab, show_rejected: gr.Checkbox, run_event) -> None:
    """`tab` is this tab (it refreshes when selected); `run_event` the Run button's (it refreshes after a run)."""

    def history_table(category, page=1):
        return history_rows(history, category, page)

    def select_row(table, selected, evt: gr.SelectData):
        run_id = str(table.iloc[evt.index[0]]["id"])
        ids = _ids(selected)
        ids = [i for i in ids if i != run_id] if run_id in ids else ids + [run_id]
        return ",".join(ids), run_id

    def open_run(run_id, show_rejected):
        row = history.run((run_id or "").strip())
        if row is None:
            empty = tokens_html([], error=f"no run {run_id!r} in the history")
            return empty, empty, "", None, None, None, None, ""
        results = history.results(row["id"])
        comparison = json.loads(row["comparison"] or "{}")
        saved = history.engines(row["id"])
        html = view(results, comparison, row["mode"] or "", show_rejected, saved)
        labels = {e: engine["label"] for e, engine in saved.items()}
        return (*html, *figures_for(results, labels), run_info(row))

    def delete_runs(selected, category, page):
        ids = _ids(selected)
        if ids:
            try:
                history.delete(ids)
            except HistoryError as e:
                gr.Warning(escape(f"Nothing was deleted: {e}"))  # a toast shows HTML
                return selected, *history_table(category, page)
        return "", *history_table(category, page)

    def exported(make):
        """The files `make` exports, or None and a warning that says why none were."""
        try:
            paths = make()
        except (ValueError, UnknownRun, HistoryError, OSError) as e:
            gr.Warning(escape(str(e)))  # a toast shows HTML
            return None
        gr.Info(escape(f"{len(paths)} file(s) in {paths[0].parent} (replaced by the next export of this kind)"))
        return [str(p) for p in paths]

    def export_selected(selected):
        return exported(lambda: export_runs(history, selected, False))

    def export_everything(selected):
        return exported(lambda: export_runs(history, selected, True))

    def replays(selected):
        """One self-contained HTML file per selected run, replaying it offline at its recorded timing."""
        return exported(lambda: export_replays(history, selected))

    # --- layout ----------------------------------------------------------------------------------------------------

    with gr.Row():
        filter_cat = gr.Dropdown(["all"] + categories(), value="all", label="Category", elem_id="history-category")
        refresh = gr.Button("Refresh", elem_id="refresh-history")
    first_page, _, first_where = history_table(None)
    table = gr.Dataframe(first_page, interactive=False, elem_id="history-table", wrap=True)
    with gr.Row():
        newer = gr.Button("◀ Newer", elem_id="history-newer", size="sm")
        page_no = gr.Number(1, precision=0, minimum=1, label="Page", elem_id="history-page", scale=0)
        older = gr.Button("Older ▶", elem_id="history-older", size="sm")
        page_info = gr.Markdown(first_where, elem_id="history-page-info")
    with gr.Row():
        selected = gr.Textbox(label="Selected run ids (click rows)", elem_id="selected-runs")
        opened_id = gr.Textbox(label="Open run id", elem_id="open-run-id")
    with gr.Row():
        open_btn = gr.Button("Open", elem_id="open-run")
        delete_btn = gr.Button("Delete selected", variant="stop")
        export_sel = gr.Button("Export selected (CSV)", elem_id="export-selected")
        export_all = gr.Button("Export all (CSV)", elem_id="export-all")
        export_replay = gr.Button("Export replay (HTML)", elem_id="export-replay")
    files = gr.File(label="Exported files", file_count="multiple", elem_id="export-files")
    info = gr.Markdown(elem_id="history-run-info")
    with gr.Row(equal_height=True):
        old_base = gr.HTML(elem_id="history-baseline")
        old_spec = gr.HTML(elem_id="history-speculative")
    old_figures = gr.HTML(elem_id="history-figures")
    with gr.Row():
        old_steps, old_pos, old_tokens = gr.Plot(), gr.Plot(), gr.Plot()
    old_time = gr.Plot()

    # --- events ----------------------------------------------------------------------------------------------------

    history_page = [table, page_no, page_info]
    # each event shows its progress on one small component: Gradio's page re-reads every component any event showed
    # progress on, on each update of a run in the Run tab (this table too; docs/page-cost.md)
    on_page, on_run = dict(show_progress_on=[page_info]), dict(show_progress_on=[info])
    run_event.then(history_table, [filter_cat, page_no], history_page, **on_page)
    refresh.click(history_table, [filter_cat, page_no], history_page, **on_page)
    filter_cat.change(history_table, filter_cat, history_page, **on_page)  # a new filter starts at its first page
    tab.select(history_table, [filter_cat, page_no], history_page, **on_page)
    newer.click(lambda c, p: history_table(c, (p or 1) - 1), [filter_cat, page_no], history_page, **on_page)
    older.click(lambda c, p: history_table(c, (p or 1) + 1), [filter_cat, page_no], history_page, **on_page)
    page_no.submit(history_table, [filter_cat, page_no], history_page, **on_page)
    table.select(select_row, [table, selected], [selected, opened_id], **on_run)
    open_btn.click(open_run, [opened_id, show_rejected],
                   [old_base, old_spec, old_figures, old_steps, old_pos, old_tokens, old_time, info], **on_run)
    delete_btn.click(delete_runs, [selected, filter_cat, page_no], [selected, *history_page], **on_page)
    # one export of a kind at a time: the next one empties the folder Gradio copies the last one's files from
    export_sel.click(export_selected, selected, files, concurrency_limit=1)
    export_all.click(export_everything, selected, files, concurrency_limit=1)
    export_replay.click(replays, selected, files, concurrency_limit=1)
