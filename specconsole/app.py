"""The Gradio console: layout and event handlers. The work is done by runner, render, charts and history."""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
import uuid
from html import escape
from pathlib import Path

import gradio as gr
import pandas as pd

from engine.request import MAX_NEW_TOKENS, Request
from engine.models import ModelError
from engine.sampling import MAX_K, SamplingParams, SettingsError
from engine.vllm_config import METHODS as VLLM_METHODS, speculative_config
from engine.vllm_server import VLLMError
from specconsole import charts
from specconsole.export import export_csv
from specconsole.history import History, HistoryError
from specconsole.host import ModelHost
from specconsole.render import PanelFeed, figures_html, legend_html, panel_notice, tokens_html
from specconsole.report import ab_chart, figures as suite_figures, write_csvs, write_html
from specconsole.runner import ENGINES, MODES, Comparison
from specconsole.suites import categories, load_file, load_suite, suite_items, suite_names
from specconsole.workbench import (SWEEPS, ab_compare, advice_for, aggregate, concurrency_sweep, run_suite,
                                   runs_frame)

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CSS = (ASSETS / "console.css").read_text()
LIVE_PANEL_JS = (ASSETS / "live_panel.js").read_text()
# The page must not take the CPU it measures: panels receive only their new tokens, five times a second at most;
# the figures twice a second; plotly re-lays out a whole chart per update, so charts once a second.
PANEL_EVERY_S = 0.2
FIGURES_EVERY_S = 0.5
CHART_EVERY_S = 1.0
HISTORY_COLUMNS = ["id", "created", "status", "category", "mode", "method", "speedup", "acceptance", "identical",
                   "sampling check", "machine", "prompt"]
HISTORY_PAGE = 100  # runs per page of the History tab: a long history is read a page at a time
QUEUED = ("Queued behind another run: runs go one at a time, because the timings of concurrent runs would share "
          "the CPU. This one starts when that one ends (Stop cancels it).")


def _rolling_acceptance(result, window: int = 8) -> float | None:
    steps = [s for s in result.steps if s.drafted > 0][-window:]
    drafted = sum(s.drafted for s in steps)
    return sum(s.accepted for s in steps) / drafted if drafted else None


def view(results: dict, comparison: dict, mode: str, show_rejected: bool):
    """HTML of both panels and the figures, from two RunResults (live or rebuilt from the history)."""
    b, s = results.get("baseline"), results.get("speculative")
    panels = []
    for r, engine in ((b, "baseline"), (s, "speculative")):
        if r is None:
            panels.append(tokens_html([], status="no data"))
            continue
        note = f"{r.finish_reason} · {len(r.output_tokens)} tokens" if r.finish_reason else "running…"
        panels.append(tokens_html(r.tokens, show_rejected and engine == "speculative", r.error, note))
    figures = figures_html(b, s, comparison, mode, _rolling_acceptance(s) if s else None)
    return panels[0], panels[1], figures


def request_from(prompt, max_new, temperature, top_p, seed, method, k, dynamic_k, confidence, fallback) -> Request:
    """The Request that the Run tab's (and the Workbench's) settings describe."""
    return Request(
        prompt=prompt or "", max_new_tokens=int(max_new),
        sampling=SamplingParams(float(temperature), 0, float(top_p), None if seed in (None, "") else int(seed)),
        method=method, k=int(k), dynamic_k=bool(dynamic_k), k_max=max(16, int(k)),
        draft_confidence=float(confidence) if method == "draft" else 0.0, fallback=bool(fallback),
    )


def live_panel(elem_id: str) -> gr.HTML:
    """A token panel that the Run tab grows in place (assets/live_panel.js): its value is the latest message."""
    return gr.HTML("", html_template='<div class="live-panel"></div>', js_on_load=LIVE_PANEL_JS, elem_id=elem_id)


def _panel_note(result) -> str:
    return f"{result.finish_reason} · {len(result.output_tokens)} tokens" if result.finish_reason else "running…"


def _ids(selected: str | None) -> list[str]:
    return [i.strip() for i in (selected or "").split(",") if i.strip()]


def figures_for(results: dict):
    b, s = results.get("baseline"), results.get("speculative")
    return charts.acceptance_per_step(s), charts.per_position(s), charts.tokens_over_time(b, s)


def _save_note(comp: Comparison) -> str:
    """Under the figures: why the run is not (completely) in the history, if it is not."""
    return f'<div class="panel-error save-error">{escape(comp.save_error)}</div>' if comp.save_error else ""


def build(host: ModelHost, history: History) -> gr.Blocks:
    active: dict[str, Comparison] = {}  # session -> its running comparison, for Stop
    queued: dict[str, threading.Event] = {}  # session -> set by Stop while its run waits for another one

    def run(prompt, category, method, k, dynamic_k, confidence, fallback, temperature, top_p, max_new, seed, mode,
            show_rejected, request: gr.Request):
        session = request.session_hash if request else "local"
        panel_run = uuid.uuid4().hex[:8]  # tells the page's panels that a new run starts
        if not host.ready:
            msg = host.status() if host.error else f"{host.status()}. Press Run again when the models are ready."
            yield panel_notice(panel_run, msg), panel_notice(panel_run, msg), "", gr.skip(), gr.skip(), gr.skip()
            return
        try:
            req = request_from(prompt, max_new, temperature, top_p, seed, method, k, dynamic_k, confidence, fallback)
            host.backend.validate(req)  # before anything runs or is saved
        except (SettingsError, ModelError, ValueError) as e:
            msg = str(e)
            yield panel_notice(panel_run, msg), panel_notice(panel_run, msg), "", gr.skip(), gr.skip(), gr.skip()
            return
        # One comparison at a time (the Run button allows several handlers so that a waiting one can say so): two
        # at once would share the CPU, and the timings of both would be wrong.
        if not host.lock.acquire(blocking=False):
            stopped = queued[session] = threading.Event()
            note = PanelFeed(panel_run).message([], QUEUED)
            yield note, note, f'<div class="status-line">{escape(QUEUED)}</div>', gr.skip(), gr.skip(), gr.skip()
            try:
                while not host.lock.acquire(timeout=1.0):
                    if stopped.is_set():
                        note = PanelFeed(panel_run).message([], "Stopped before it started.")
                        yield note, note, "", gr.skip(), gr.skip(), gr.skip()
                        return
                    yield (gr.skip(),) * 6  # gives gradio the chance to drop the run of a page that was closed
            finally:
                queued.pop(session, None)
        try:
            meta = {"method": method, **host.backend.describe(), "category": category}
            if meta["backend"] == "local" and method != "draft":
                meta["draft_model"] = None
            comp = Comparison(host.backend, req, mode, history, meta)
            active[session] = comp
            comp.start()
            feeds = {e: PanelFeed(panel_run, show_rejected and e == "speculative") for e in ENGINES}
            last_panel = last_figures = last_chart = 0.0
            try:
                while True:
                    done = comp.poll(timeout=PANEL_EVERY_S)
                    now = time.monotonic()
                    if not done and now - last_panel < PANEL_EVERY_S:
                        continue
                    figures_due = done or now - last_figures >= FIGURES_EVERY_S
                    chart_due = done or now - last_chart >= CHART_EVERY_S
                    with comp.ui_lock:  # in fair mode: never while an engine's pass is being timed
                        results = comp.results
                        panels = [feeds[e].message(results[e].tokens, _panel_note(results[e]), results[e].error,
                                                   final=done) for e in ENGINES]
                        if figures_due:
                            s = results["speculative"]
                            figures = figures_html(results["baseline"], s, comp.comparison(results), mode,
                                                   _rolling_acceptance(s)) + _save_note(comp)
                        charts = figures_for(results) if chart_due else (gr.skip(),) * 3
                    last_panel = now
                    last_figures, last_chart = (now if figures_due else last_figures), (now if chart_due else last_chart)
                    yield (*[gr.skip() if p is None else p for p in panels],
                           figures if figures_due else gr.skip(), *charts)
                    if done:
                        break
            finally:
                comp.cancel.set()  # a closed tab or an error must not leave the engines running
                active.pop(session, None)
        finally:
            host.lock.release()
        if comp.save_error:
            gr.Warning(comp.save_error)

    def reconfigure_vllm(method, k, draft):
        if not host.ready or not host.backend.capabilities.can_reconfigure:
            return "Only a managed vLLM backend (`--backend vllm`) can be reconfigured from here."
        try:
            config = speculative_config(method, int(k), draft or None)
            with host.lock:
                host.backend.reconfigure(config)
        except VLLMError as e:
            return f"Could not apply: {escape(str(e))}"
        return f"Speculative server running with `{escape(json.dumps(config))}`."

    def stop(request: gr.Request):
        session = request.session_hash if request else "local"
        comp = active.get(session)
        if comp:
            comp.cancel.set()
        if session in queued:
            queued[session].set()

    def pick_category(category):
        prompts = load_suite(category)
        choices = [(f"{i + 1}. {p.prompt[:90]}", i) for i, p in enumerate(prompts)]
        first = prompts[0]
        return gr.update(choices=choices, value=0), first.prompt, first.temperature

    def pick_example(category, index):
        if index is None:
            return gr.skip(), gr.skip()
        item = load_suite(category)[int(index)]
        return item.prompt, item.temperature

    # --- history ---------------------------------------------------------------------------------------------------

    def history_table(category, page=1):
        """One page of the history: the table, the page number (kept in range) and the line that says where it is."""
        rows, total, page = history.page(category if category and category != "all" else None, int(page or 1),
                                         HISTORY_PAGE)
        pages = max(1, -(-total // HISTORY_PAGE))
        where = f"page {page} of {pages} · {total:,} run{'s' if total != 1 else ''}"
        return pd.DataFrame(
            [[r["id"], (r["created_at"] or "")[:19].replace("T", " "), r["status"], r["category"], r["mode"],
              r["method"], None if r["speedup"] is None else round(r["speedup"], 2),
              None if r["acceptance_rate"] is None else round(r["acceptance_rate"], 2),
              {1: "yes", 0: "no"}.get(r["identical"], ""), r.get("sampling_check") or "",
              {1: "noisy", 0: "quiet"}.get(r["noisy"], ""),
              r["prompt"] or ""] for r in rows],
            columns=HISTORY_COLUMNS,
        ), page, where

    def select_row(table, selected, evt: gr.SelectData):
        run_id = str(table.iloc[evt.index[0]]["id"])
        ids = _ids(selected)
        ids = [i for i in ids if i != run_id] if run_id in ids else ids + [run_id]
        return ",".join(ids), run_id

    def open_run(run_id, show_rejected):
        row = history.run((run_id or "").strip())
        if row is None:
            empty = tokens_html([], error=f"no run {run_id!r} in the history")
            return empty, empty, "", None, None, None, ""
        results = history.results(row["id"])
        comparison = json.loads(row["comparison"] or "{}")
        html = view(results, comparison, row["mode"] or "", show_rejected)
        info = (f"**{escape(row['status'])}** · {escape(row['created_at'] or '')} · {escape(row['category'] or '')} · "
                f"method {escape(row['method'] or '')} · mode {escape(row['mode'] or '')}"
                + (f" · error: {escape(row['error'])}" if row["error"] else "")
                + f"\n\n> {escape((row['prompt'] or '')[:300])}")
        return (*html, *figures_for(results), info)

    def delete_runs(selected, category, page):
        ids = _ids(selected)
        if ids:
            try:
                history.delete(ids)
            except HistoryError as e:
                gr.Warning(f"Nothing was deleted: {e}")
                return selected, *history_table(category, page)
        return "", *history_table(category, page)

    def export(selected, everything: bool):
        ids = None if everything else _ids(selected)
        if not everything and not ids:
            gr.Warning("Select runs in the table first (click a row), or export the whole history.")
            return None
        out = Path(tempfile.mkdtemp(prefix="specconsole-export-"))
        return [str(p) for p in export_csv(history, out, ids)]

    # --- workbench -------------------------------------------------------------------------------------------------

    active_suites: dict[str, threading.Event] = {}
    concurrency_results: dict[str, pd.DataFrame] = {}

    def suite_view(suite_id: str, variable: str | None):
        runs = runs_frame(history, suite_id)
        agg = aggregate(runs)
        # the advisor also weighs the latest concurrency sweep of this console (vLLM), if one was run
        conc = concurrency_results.get(suite_id)
        latest = list(concurrency_results.values())[-1] if concurrency_results else None
        advice = advice_for(host.backend, agg, variable, latest)
        table = agg.drop(columns=["per_position", "prompt_speedups"]).round(3) if not agg.empty else conc
        figs = suite_figures(agg if not agg.empty else pd.DataFrame(columns=["category", "sweep_value"]), conc)
        figs += [None] * (4 - len(figs))
        text = "\n\n".join(a.markdown() for a in advice) or (
            "Concurrency sweep: see the table and chart." if conc is not None else "No completed runs to advise on.")
        return table, *figs[:4], text

    def run_suite_ui(cats_chosen, upload, n, max_tokens, variable, values, method, k, dynamic_k, confidence,
                     fallback, top_p, seed, mode, repeats, request: gr.Request):
        session = request.session_hash if request else "local"
        nothing = (gr.skip(),) * 7  # the suite id, the table, four charts and the advice stay as they are
        if not host.ready:
            yield f'<div class="panel-error">{escape(host.status())}</div>', *nothing
            return
        try:
            items = [item for c in (cats_chosen or []) for item in suite_items(c, int(n))]
            if upload:
                items += load_file(upload)[: int(n)]
            if not items:
                raise ValueError("choose at least one suite or upload a JSONL / CSV file")
            vals = [v.strip() for v in (values or "").split(",") if v.strip()] or SWEEPS[variable]
            # the prompt and temperature come from each suite entry
            base = request_from("-", max_tokens, 0.0, top_p, seed, method, k, dynamic_k, confidence, fallback)
            base.validate()
        except (ValueError, SettingsError) as e:
            yield f'<div class="panel-error">{escape(str(e))}</div>', *nothing
            return
        cancel = threading.Event()
        active_suites[session] = cancel
        runs_each = 1 if variable == "concurrency" else len(vals) * int(repeats)
        progress = {"done": 0, "total": len(items) * runs_each, "what": ""}
        outcome: dict = {}

        def work():
            try:
                if variable == "concurrency":
                    sid = f"conc-{int(time.time())}"
                    concurrency_results[sid] = concurrency_sweep(
                        host.backend, items, [int(v) for v in vals], int(max_tokens),
                        lambda d, t, w: progress.update(done=d, total=t, what=w))
                    outcome["suite_id"] = sid
                    return
                meta = {"method": method, **host.backend.describe()}
                result = run_suite(host.backend, items, base, history, meta, mode, variable, vals, cancel=cancel,
                                   on_progress=lambda d, t, w: progress.update(done=d, total=t, what=w),
                                   repeats=int(repeats))
                outcome["suite_id"], outcome["cancelled"] = result.suite_id, result.cancelled
            except Exception as e:  # noqa: BLE001 - shown in the page
                log.exception("suite failed")
                outcome["error"] = f"{type(e).__name__}: {e}"

        with host.lock:
            worker = threading.Thread(target=work, daemon=True, name="specconsole-suite")
            worker.start()
            try:
                while worker.is_alive():
                    worker.join(0.5)
                    pct = 100 * progress["done"] / max(1, progress["total"])
                    bar = (f'<div class="status-line">{progress["done"]} of {progress["total"]} runs '
                           f'({pct:.0f}%) {escape(progress["what"])}</div>'
                           f'<progress max="100" value="{pct:.0f}" style="width:100%"></progress>')
                    yield bar, *nothing
            finally:
                if worker.is_alive():  # the page went away: stop the suite after its current run
                    cancel.set()
                active_suites.pop(session, None)
        if "error" in outcome:
            yield f'<div class="panel-error">{escape(outcome["error"])}</div>', *nothing
            return
        sid = outcome["suite_id"]
        note = " (stopped: the runs completed before Stop are kept)" if outcome.get("cancelled") else ""
        status_html = f'<div class="status-line">Suite {escape(sid)} finished{note}.</div>'
        yield status_html, sid, *suite_view(sid, None if variable == "none" else variable)

    def stop_suite(request: gr.Request):
        cancel = active_suites.get(request.session_hash if request else "local")
        if cancel:
            cancel.set()

    def export_suite(suite_id):
        suite_id = (suite_id or "").strip()
        if not suite_id:
            gr.Warning("Run or pick a suite first.")
            return None
        out = Path(tempfile.mkdtemp(prefix="specconsole-suite-"))
        conc = concurrency_results.get(suite_id)
        if conc is not None:
            path = out / f"suite_{suite_id}_concurrency.csv"
            conc.to_csv(path, index=False)
            return [str(path), str(write_html(pd.DataFrame(columns=["category", "sweep_value"]), [],
                                              out / f"suite_{suite_id}.html", suite_id, host.label, conc))]
        runs = runs_frame(history, suite_id)
        agg = aggregate(runs)
        variable = next((v for v in runs.get("sweep_variable", []) if v), None) if not runs.empty else None
        paths = write_csvs(runs, agg, out / f"suite_{suite_id}.csv")
        paths.append(write_html(agg, advice_for(host.backend, agg, variable), out / f"suite_{suite_id}.html", suite_id,
                                host.label))
        return [str(p) for p in paths]

    def suite_choices():
        ids = [r["suite_id"] for r in history.suites()]
        return gr.update(choices=ids), gr.update(choices=ids)

    def compare_suites(a, b):
        if not a or not b:
            return None, None, ""
        ab = ab_compare(runs_frame(history, a), runs_frame(history, b))
        lines = [f"**{r['category']}{' ' + r['sweep_value'] if r['sweep_value'] else ''}**: {escape(r['conclusion'])}"
                 for _, r in ab.iterrows()]
        return ab.round(3), ab_chart(ab, f"A {a}", f"B {b}"), "\n\n".join(lines)

    # --- layout ----------------------------------------------------------------------------------------------------

    cats = categories()
    with gr.Blocks(title="SpecConsole") as app:
        gr.Markdown("## SpecConsole — speculative decoding, side by side")
        status = gr.HTML(f'<div class="status-line">{escape(host.status())}</div>', elem_id="model-status")
        timer = gr.Timer(1.0)

        def model_status():  # once the models are ready (or failed), the page stops asking
            settled = host.ready or host.error is not None
            return f'<div class="status-line">{escape(host.status())}</div>', gr.Timer(active=not settled)

        timer.tick(model_status, outputs=[status, timer], show_progress="hidden")

        with gr.Tab("Run"):
            with gr.Row():
                with gr.Column(scale=3):
                    category = gr.Dropdown(cats, value=cats[0] if cats else None, label="Category")
                    example = gr.Dropdown([], label="Example prompt", allow_custom_value=False)
                    prompt = gr.Textbox(label="Prompt", lines=6, elem_id="prompt")
                    with gr.Row():
                        run_btn = gr.Button("Run", variant="primary", elem_id="run")
                        stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                with gr.Column(scale=2):
                    gr.Markdown(f"Backend: **{escape(host.label)}**")
                    with gr.Accordion("vLLM speculative server (managed vLLM backend)", open=False):
                        vllm_method = gr.Dropdown(list(VLLM_METHODS), value="ngram", label="Method")
                        vllm_k = gr.Slider(1, 16, value=4, step=1, label="num_speculative_tokens (K)")
                        vllm_draft = gr.Textbox(label="Draft / EAGLE / Medusa model path")
                        vllm_apply = gr.Button("Apply (restarts the speculative server)")
                        vllm_status = gr.Markdown()
                    method = gr.Radio(["draft", "ngram"], value=host.method, label="Drafting method (local backend)")
                    with gr.Row():
                        k = gr.Slider(1, MAX_K, value=4, step=1, label="K (draft tokens per step)")
                        dynamic_k = gr.Checkbox(
                            value=True, label="Dynamic K",
                            info="draft model: keeps drafting while one more token is expected to pay "
                                 "(up to 16, or K if higher); n-gram: K from the measured costs")
                    with gr.Row():
                        confidence = gr.Slider(0.0, 0.95, value=0.4, step=0.05, label="Draft stops below confidence")
                        fallback = gr.Checkbox(value=False, label="Fall back to plain decoding when it does not pay")
                    with gr.Row():
                        temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="Temperature (0 = greedy)",
                                                elem_id="temperature")
                        top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p")
                    with gr.Row():
                        max_new = gr.Slider(1, MAX_NEW_TOKENS, value=128, step=1, label="Max new tokens",
                                            elem_id="max-new")
                        seed = gr.Number(value=0, precision=0, label="Seed")
                    with gr.Row():
                        mode = gr.Radio(list(MODES), value="fair", label="Mode",
                                        info="fair: engines take turns, each timed alone; race: both at once")
                        show_rejected = gr.Checkbox(value=True, label="Show rejected drafts")
            gr.HTML(legend_html())
            with gr.Row(equal_height=True):
                with gr.Column():
                    gr.Markdown("**Baseline** — target only, one token per pass")
                    base_panel = live_panel("baseline-panel")
                with gr.Column():
                    gr.Markdown("**Speculative** — draft proposes, target verifies")
                    spec_panel = live_panel("speculative-panel")
            figures = gr.HTML("", elem_id="figures")
            empty = figures_for({})  # also loads plotly's templates now rather than during the first run
            with gr.Row():
                chart_steps = gr.Plot(empty[0], label="Acceptance per step", elem_id="chart-steps")
                chart_pos = gr.Plot(empty[1], label="Per-position acceptance", elem_id="chart-positions")
                chart_tokens = gr.Plot(empty[2], label="Tokens over time", elem_id="chart-tokens")

        with gr.Tab("History", elem_id="history-tab") as history_tab:
            with gr.Row():
                filter_cat = gr.Dropdown(["all"] + cats, value="all", label="Category", elem_id="history-category")
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
            files = gr.File(label="CSV files", file_count="multiple", elem_id="export-files")
            info = gr.Markdown(elem_id="history-run-info")
            with gr.Row(equal_height=True):
                old_base = gr.HTML(elem_id="history-baseline")
                old_spec = gr.HTML(elem_id="history-speculative")
            old_figures = gr.HTML(elem_id="history-figures")
            with gr.Row():
                old_steps, old_pos, old_tokens = gr.Plot(), gr.Plot(), gr.Plot()

        with gr.Tab("Workbench", elem_id="workbench-tab") as workbench_tab:
            gr.Markdown("Run prompt suites on both engines (settings from the Run tab), sweep one variable, and see "
                        "per category whether speculative decoding pays.")
            with gr.Row():
                suite_cats = gr.CheckboxGroup(suite_names(), value=["code"], label="Suites", elem_id="suite-categories")
                suite_file = gr.File(label="Or your own suite (JSONL / CSV)", file_types=[".jsonl", ".csv"],
                                     type="filepath")
            with gr.Row():
                suite_n = gr.Slider(1, 8, value=2, step=1, label="Prompts per suite", elem_id="suite-n")
                suite_repeats = gr.Slider(1, 5, value=1, step=1, label="Repeats", elem_id="suite-repeats",
                                          info="per prompt; 2+ measure the noise")
                suite_tokens = gr.Slider(8, 512, value=64, step=8, label="Max new tokens", elem_id="suite-tokens")
                sweep_var = gr.Dropdown(list(SWEEPS), value="none", label="Sweep")
                sweep_vals = gr.Textbox(label="Sweep values (comma-separated; empty: the usual ones)")
            with gr.Row():
                suite_btn = gr.Button("Run suite", variant="primary", elem_id="run-suite")
                suite_stop = gr.Button("Stop suite", variant="stop")
            suite_status = gr.HTML(elem_id="suite-status")
            suite_table = gr.Dataframe(elem_id="suite-table", interactive=False)
            with gr.Row():
                suite_speed = gr.Plot(elem_id="suite-speedup")
                suite_acc = gr.Plot(elem_id="suite-acceptance")
            with gr.Row():
                suite_lat = gr.Plot(elem_id="suite-latency")
                suite_conc = gr.Plot(elem_id="suite-concurrency")
            advice_md = gr.Markdown(elem_id="advice")
            with gr.Row():
                suite_id_box = gr.Textbox(label="Suite id", elem_id="suite-id")
                export_suite_btn = gr.Button("Export suite (CSV + HTML report)", elem_id="export-suite")
            suite_files = gr.File(label="Suite files", file_count="multiple", elem_id="suite-files")
            gr.Markdown("### A/B of two suites")
            with gr.Row():
                ab_a = gr.Dropdown([], label="Suite A")
                ab_b = gr.Dropdown([], label="Suite B")
                ab_btn = gr.Button("Compare")
            ab_table = gr.Dataframe(interactive=False)
            ab_plot = gr.Plot()
            ab_text = gr.Markdown(elem_id="ab-conclusion")

        inputs = [prompt, category, method, k, dynamic_k, confidence, fallback, temperature, top_p, max_new, seed,
                  mode, show_rejected]
        outputs = [base_panel, spec_panel, figures, chart_steps, chart_pos, chart_tokens]
        # no progress overlay: its animation would cost the browser CPU during the very run it shows
        # up to 4 handlers: one runs, the others wait in run() for host.lock and say that they are queued
        run_event = run_btn.click(run, inputs, outputs, concurrency_limit=4, concurrency_id="runs",
                                  show_progress="hidden")
        history_page = [table, page_no, page_info]
        run_event.then(history_table, [filter_cat, page_no], history_page)
        stop_btn.click(stop, None, None, concurrency_limit=None)
        category.change(pick_category, category, [example, prompt, temperature])
        example.input(pick_example, [category, example], [prompt, temperature])
        app.load(pick_category, category, [example, prompt, temperature])

        refresh.click(history_table, [filter_cat, page_no], history_page)
        filter_cat.change(history_table, filter_cat, history_page)  # a new filter starts at its first page
        history_tab.select(history_table, [filter_cat, page_no], history_page)
        newer.click(lambda c, p: history_table(c, (p or 1) - 1), [filter_cat, page_no], history_page)
        older.click(lambda c, p: history_table(c, (p or 1) + 1), [filter_cat, page_no], history_page)
        page_no.submit(history_table, [filter_cat, page_no], history_page)
        vllm_apply.click(reconfigure_vllm, [vllm_method, vllm_k, vllm_draft], vllm_status, concurrency_limit=1,
                         concurrency_id="engines")
        table.select(select_row, [table, selected], [selected, opened_id])
        open_btn.click(open_run, [opened_id, show_rejected],
                       [old_base, old_spec, old_figures, old_steps, old_pos, old_tokens, info])
        delete_btn.click(delete_runs, [selected, filter_cat, page_no], [selected, *history_page])
        export_sel.click(lambda s: export(s, False), selected, files)
        export_all.click(lambda s: export(s, True), selected, files)

        suite_inputs = [suite_cats, suite_file, suite_n, suite_tokens, sweep_var, sweep_vals, method, k, dynamic_k,
                        confidence, fallback, top_p, seed, mode, suite_repeats]
        suite_outputs = [suite_status, suite_id_box, suite_table, suite_speed, suite_acc, suite_lat, suite_conc,
                         advice_md]
        suite_event = suite_btn.click(run_suite_ui, suite_inputs, suite_outputs, concurrency_limit=1,
                                      concurrency_id="engines")
        suite_event.then(suite_choices, None, [ab_a, ab_b])
        suite_stop.click(stop_suite, None, None, concurrency_limit=None)
        export_suite_btn.click(export_suite, suite_id_box, suite_files)
        workbench_tab.select(suite_choices, None, [ab_a, ab_b])
        ab_btn.click(compare_suites, [ab_a, ab_b], [ab_table, ab_plot, ab_text])
    return app


def launch(host: ModelHost, history: History, server_name: str, port: int, auth=None, prevent_thread_lock=False):
    app = build(host, history)
    app.queue(default_concurrency_limit=4)
    return app.launch(server_name=server_name, server_port=port, auth=auth, css=CSS, show_error=True,
                      prevent_thread_lock=prevent_thread_lock, footer_links=[])


__all__ = ["build", "launch", "HistoryError"]
