"""The Gradio console: layout and event handlers. The work is done by runner, render, charts and history."""

from __future__ import annotations

import json
import logging
import tempfile
import time
from html import escape
from pathlib import Path

import gradio as gr
import pandas as pd

from engine.backend import MAX_NEW_TOKENS, Request
from engine.models import ModelError
from engine.sampling import MAX_K, SamplingParams, SettingsError
from specconsole import charts
from specconsole.export import export_csv
from specconsole.history import History, HistoryError
from specconsole.host import ModelHost
from specconsole.render import figures_html, legend_html, tokens_html
from specconsole.runner import MODES, Comparison
from specconsole.suites import categories, load_suite

log = logging.getLogger(__name__)

CSS = (Path(__file__).resolve().parent.parent / "assets" / "console.css").read_text()
PANEL_EVERY_S = 0.1  # token panels: ten updates a second look live
CHART_EVERY_S = 0.5  # plotly figures are heavy to re-send: twice a second
HISTORY_COLUMNS = ["id", "created", "status", "category", "mode", "method", "speedup", "acceptance", "identical",
                   "prompt"]


def _rolling_acceptance(result, window: int = 8) -> float | None:
    steps = [s for s in result.steps if s.drafted > 0][-window:]
    drafted = sum(s.drafted for s in steps)
    return sum(s.accepted for s in steps) / drafted if drafted else None


def view(results: dict, comparison: dict, mode: str, show_rejected: bool, status: dict | None = None):
    """HTML of both panels and the figures, from two RunResults (live or rebuilt from the history)."""
    b, s = results.get("baseline"), results.get("speculative")
    status = status or {}
    panels = []
    for r, engine in ((b, "baseline"), (s, "speculative")):
        if r is None:
            panels.append(tokens_html([], status="no data"))
            continue
        note = status.get(engine) or (f"{r.finish_reason} · {len(r.output_ids or r.output_tokens)} tokens"
                                      if r.finish_reason else "running…")
        panels.append(tokens_html(r.tokens, show_rejected and engine == "speculative", r.error, note))
    figures = figures_html(b, s, comparison, mode, _rolling_acceptance(s) if s else None)
    return panels[0], panels[1], figures


def figures_for(results: dict):
    b, s = results.get("baseline"), results.get("speculative")
    return charts.acceptance_per_step(s), charts.per_position(s), charts.tokens_over_time(b, s)


def build(host: ModelHost, history: History) -> gr.Blocks:
    active: dict[str, Comparison] = {}  # session -> its running comparison, for Stop

    def run(prompt, category, method, k, dynamic_k, confidence, fallback, temperature, top_p, max_new, seed, mode,
            show_rejected, request: gr.Request):
        session = request.session_hash if request else "local"
        if not host.ready:
            msg = host.status() if host.error else f"{host.status()}. Press Run again when the models are ready."
            yield tokens_html([], error=msg), tokens_html([], error=msg), "", gr.skip(), gr.skip(), gr.skip()
            return
        try:
            req = Request(
                prompt=prompt or "", max_new_tokens=int(max_new),
                sampling=SamplingParams(float(temperature), 0, float(top_p), None if seed in (None, "") else int(seed)),
                method=method, k=int(k), dynamic_k=bool(dynamic_k), k_max=max(16, int(k)),
                draft_confidence=float(confidence) if method == "draft" else 0.0, fallback=bool(fallback),
            )
            host.backend.prompt_ids(req)  # validate before anything runs or is saved
        except (SettingsError, ModelError, ValueError) as e:
            yield tokens_html([], error=str(e)), tokens_html([], error=str(e)), "", gr.skip(), gr.skip(), gr.skip()
            return
        with host.lock:
            meta = {"method": method, **host.backend.describe(), "category": category}
            if meta["backend"] == "local" and method != "draft":
                meta["draft_model"] = None
            comp = Comparison(host.backend, req, mode, history, meta)
            active[session] = comp
            comp.start()
            last_panel = last_chart = 0.0
            try:
                while True:
                    done = comp.poll(timeout=PANEL_EVERY_S / 2)
                    now = time.monotonic()
                    if done or now - last_panel >= PANEL_EVERY_S:
                        last_panel = now
                        chart = done or now - last_chart >= CHART_EVERY_S
                        with comp.ui_lock:  # in fair mode: never while an engine's pass is being timed
                            results = comp.results
                            html = view(results, comp.comparison(), mode, show_rejected)
                            figs = figures_for(results) if chart else (gr.skip(), gr.skip(), gr.skip())
                        if chart:
                            last_chart = now
                        yield (*html, *figs)
                    if done:
                        break
            finally:
                comp.cancel.set()  # a closed tab or an error must not leave the engines running
                active.pop(session, None)
        if comp.save_error:
            gr.Warning(comp.save_error)

    def stop(request: gr.Request):
        comp = active.get(request.session_hash if request else "local")
        if comp:
            comp.cancel.set()

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

    def history_table(category):
        rows = history.runs(category if category and category != "all" else None)
        return pd.DataFrame(
            [[r["id"], (r["created_at"] or "")[:19].replace("T", " "), r["status"], r["category"], r["mode"],
              r["method"], None if r["speedup"] is None else round(r["speedup"], 2),
              None if r["acceptance_rate"] is None else round(r["acceptance_rate"], 2),
              {1: "yes", 0: "no"}.get(r["identical"], ""), (r["prompt"] or "")[:80]] for r in rows],
            columns=HISTORY_COLUMNS,
        )

    def select_row(table, selected, evt: gr.SelectData):
        run_id = str(table.iloc[evt.index[0]]["id"])
        ids = [i for i in (selected or "").split(",") if i.strip()]
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

    def delete_runs(selected, category):
        ids = [i.strip() for i in (selected or "").split(",") if i.strip()]
        if ids:
            history.delete(ids)
        return "", history_table(category)

    def export(selected, everything: bool):
        ids = None if everything else [i.strip() for i in (selected or "").split(",") if i.strip()]
        if not everything and not ids:
            gr.Warning("Select runs in the table first (click a row), or export the whole history.")
            return None
        out = Path(tempfile.mkdtemp(prefix="specconsole-export-"))
        return [str(p) for p in export_csv(history, out, ids)]

    # --- layout ----------------------------------------------------------------------------------------------------

    cats = categories()
    with gr.Blocks(title="SpecConsole") as app:
        gr.Markdown("## SpecConsole — speculative decoding, side by side")
        status = gr.HTML(f'<div class="status-line">{escape(host.status())}</div>', elem_id="model-status")
        timer = gr.Timer(1.0)
        timer.tick(lambda: f'<div class="status-line">{escape(host.status())}</div>', outputs=status)

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
                    method = gr.Radio(["draft", "ngram"], value=host.method, label="Drafting method (local backend)")
                    with gr.Row():
                        k = gr.Slider(1, MAX_K, value=4, step=1, label="K (draft tokens per step)")
                        dynamic_k = gr.Checkbox(value=True, label="Dynamic K")
                    with gr.Row():
                        confidence = gr.Slider(0.0, 0.95, value=0.4, step=0.05, label="Draft stops below confidence")
                        fallback = gr.Checkbox(value=False, label="Fall back to plain decoding when it does not pay")
                    with gr.Row():
                        temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="Temperature (0 = greedy)",
                                                elem_id="temperature")
                        top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p")
                    with gr.Row():
                        max_new = gr.Slider(1, MAX_NEW_TOKENS, value=128, step=1, label="Max new tokens")
                        seed = gr.Number(value=0, precision=0, label="Seed")
                    with gr.Row():
                        mode = gr.Radio(list(MODES), value="fair", label="Mode",
                                        info="fair: engines take turns, each timed alone; race: both at once")
                        show_rejected = gr.Checkbox(value=True, label="Show rejected drafts")
            gr.HTML(legend_html())
            with gr.Row(equal_height=True):
                with gr.Column():
                    gr.Markdown("**Baseline** — target only, one token per pass")
                    base_panel = gr.HTML(tokens_html([]), elem_id="baseline-panel")
                with gr.Column():
                    gr.Markdown("**Speculative** — draft proposes, target verifies")
                    spec_panel = gr.HTML(tokens_html([]), elem_id="speculative-panel")
            figures = gr.HTML("", elem_id="figures")
            empty = figures_for({})  # also loads plotly's templates now rather than during the first run
            with gr.Row():
                chart_steps = gr.Plot(empty[0], label="Acceptance per step", elem_id="chart-steps")
                chart_pos = gr.Plot(empty[1], label="Per-position acceptance", elem_id="chart-positions")
                chart_tokens = gr.Plot(empty[2], label="Tokens over time", elem_id="chart-tokens")

        with gr.Tab("History", elem_id="history-tab") as history_tab:
            with gr.Row():
                filter_cat = gr.Dropdown(["all"] + cats, value="all", label="Category")
                refresh = gr.Button("Refresh", elem_id="refresh-history")
            table = gr.Dataframe(history_table(None), interactive=False, elem_id="history-table", wrap=True)
            with gr.Row():
                selected = gr.Textbox(label="Selected run ids (click rows)", elem_id="selected-runs")
                opened_id = gr.Textbox(label="Open run id", elem_id="open-run-id")
            with gr.Row():
                open_btn = gr.Button("Open", elem_id="open-run")
                delete_btn = gr.Button("Delete selected", variant="stop")
                export_sel = gr.Button("Export selected (CSV)", elem_id="export-selected")
                export_all = gr.Button("Export all (CSV)", elem_id="export-all")
            files = gr.File(label="CSV files", file_count="multiple", elem_id="export-files")
            info = gr.Markdown()
            with gr.Row(equal_height=True):
                old_base = gr.HTML()
                old_spec = gr.HTML()
            old_figures = gr.HTML()
            with gr.Row():
                old_steps, old_pos, old_tokens = gr.Plot(), gr.Plot(), gr.Plot()

        inputs = [prompt, category, method, k, dynamic_k, confidence, fallback, temperature, top_p, max_new, seed,
                  mode, show_rejected]
        outputs = [base_panel, spec_panel, figures, chart_steps, chart_pos, chart_tokens]
        run_event = run_btn.click(run, inputs, outputs, concurrency_limit=1, concurrency_id="engines")
        run_event.then(history_table, filter_cat, table)
        stop_btn.click(stop, None, None, concurrency_limit=None)
        category.change(pick_category, category, [example, prompt, temperature])
        example.input(pick_example, [category, example], [prompt, temperature])
        app.load(pick_category, category, [example, prompt, temperature])

        refresh.click(history_table, filter_cat, table)
        filter_cat.change(history_table, filter_cat, table)
        history_tab.select(history_table, filter_cat, table)
        table.select(select_row, [table, selected], [selected, opened_id])
        open_btn.click(open_run, [opened_id, show_rejected],
                       [old_base, old_spec, old_figures, old_steps, old_pos, old_tokens, info])
        delete_btn.click(delete_runs, [selected, filter_cat], [selected, table])
        export_sel.click(lambda s: export(s, False), selected, files)
        export_all.click(lambda s: export(s, True), selected, files)
    return app


def launch(host: ModelHost, history: History, server_name: str, port: int, auth=None, prevent_thread_lock=False):
    app = build(host, history)
    app.queue(default_concurrency_limit=4)
    return app.launch(server_name=server_name, server_port=port, auth=auth, css=CSS, show_error=True,
                      prevent_thread_lock=prevent_thread_lock, footer_links=[])


__all__ = ["build", "launch", "HistoryError"]
