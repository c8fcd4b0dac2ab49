"""The Workbench tab: prompt suites on both engines with the Run tab's settings (a SuiteJob each), the aggregates,
charts and advice, the suite's export, and the A/B of two suites."""

from __future__ import annotations

from html import escape

import gradio as gr
import pandas as pd

from engine.request import SUITE_MAX_NEW_TOKENS, build_request
from engine.limits import SettingsError
from specconsole.history import History
from specconsole.host import ModelHost
from specconsole.markup import md
from specconsole.report import ab_chart, figures as suite_figures
from specconsole.suite_job import SuiteJob, export_suite_files
from specconsole.suites import load_file, suite_items, suite_names
from specconsole.run_layout import RunSettings
from specconsole.workbench import SWEEPS, ab_compare, advice_for, aggregate, check_plan, runs_frame

PROGRESS_EVERY_S = 0.5


def _error(message: str) -> str:
    return f'<div class="panel-error">{escape(message)}</div>'


def ab_markdown(ab: pd.DataFrame) -> str:
    """workbench.ab_compare's conclusions, one line per category (and sweep value)."""
    lines = []
    for _, r in ab.iterrows():
        where = f"{r['category']} {r['sweep_value']}" if r["sweep_value"] else r["category"]
        lines.append(f"**{md(where)}**: {md(r['conclusion'])}")
    return "\n\n".join(lines)


def build(host: ModelHost, history: History, tab: gr.Tab, settings: RunSettings) -> None:
    """`tab` is this tab (the A/B choices refresh when selected); `settings` the Run tab's drafting controls."""
    active_suites: dict[str, SuiteJob] = {}  # session -> its running job, for Stop
    concurrency_results: dict[str, pd.DataFrame] = {}  # suite id -> a concurrency sweep of this console (not saved)

    def suite_view(suite_id: str, variable: str | None):
        runs = runs_frame(history, suite_id)
        agg = aggregate(runs)
        # the advisor also weighs the latest concurrency sweep of this console (vLLM), if one was run
        conc = concurrency_results.get(suite_id)
        latest = list(concurrency_results.values())[-1] if concurrency_results else None
        advice = advice_for(host.backend, agg, variable, latest)
        table = agg.drop(columns=["per_position", "prompt_speedups"]).round(3) if not agg.empty else conc
        if not agg.empty:  # steps by drafts accepted, as the Run tab shows them
            table["histogram"] = [" · ".join(f"{i}: {n}" for i, n in enumerate(h)) if isinstance(h, list)
                                  else "unknown" for h in table["histogram"]]
        figs = suite_figures(agg if not agg.empty else pd.DataFrame(columns=["category", "sweep_value"]), conc)
        figs += [None] * (4 - len(figs))
        text = "\n\n".join(a.markdown() for a in advice) or (
            "Concurrency sweep: see the table and chart." if conc is not None else "No completed runs to advise on.")
        return table, *figs[:4], text

    def run_suite_ui(cats_chosen, upload, n, max_tokens, variable, values, method, k, dynamic_k, confidence,
                     draft_vocab, fallback, top_p, seed, mode, repeats, request: gr.Request):
        session = request.session_hash if request else "local"
        nothing = (gr.skip(),) * 7  # the suite id, the table, four charts and the advice stay as they are
        if not host.ready:
            yield _error(host.status()), *nothing
            return
        try:
            vals = [v.strip() for v in (values or "").split(",") if v.strip()] or None
            check_plan(variable, vals, int(repeats), int(n))  # engine.limits, before any file is read
            items = [item for c in (cats_chosen or []) for item in suite_items(c, int(n))]
            if upload:
                items += load_file(upload)[: int(n)]
            # the prompt and the temperature come from each suite entry
            base = build_request("", max_new_tokens=max_tokens, top_p=top_p, seed=seed, method=method, k=k,
                                 dynamic_k=dynamic_k, draft_confidence=confidence, fallback=fallback,
                                 draft_vocab=draft_vocab)
            job = SuiteJob(host.backend, history, items, base, mode, variable, vals, int(repeats))
            job.check()
        except (ValueError, SettingsError) as e:
            yield _error(str(e)), *nothing
            return
        with host.lock:  # one thing on the engines at a time: the Run tab waits meanwhile
            active_suites[session] = job.start()
            try:
                while not job.wait(PROGRESS_EVERY_S):
                    bar = (f'<div class="status-line">{job.done} of {job.total} runs ({job.percent:.0f}%) '
                           f'{escape(job.what)}</div>'
                           f'<progress max="100" value="{job.percent:.0f}" style="width:100%"></progress>')
                    yield bar, *nothing
            finally:
                if job.running():  # the page went away: stop the suite after its current run
                    job.cancel.set()
                active_suites.pop(session, None)
        if job.error:
            yield _error(job.error), *nothing
            return
        if job.concurrency is not None and not job.concurrency.empty:  # empty: stopped before its first level
            concurrency_results[job.suite_id] = job.concurrency
        note = " (stopped: the runs completed before Stop are kept)" if job.cancelled else ""
        status_html = f'<div class="status-line">Suite {escape(job.suite_id)} finished{note}.</div>'
        yield status_html, job.suite_id, *suite_view(job.suite_id, job.sweep)

    def stop_suite(request: gr.Request):
        job = active_suites.get(request.session_hash if request else "local")
        if job:
            job.cancel.set()

    def export(suite_id):
        if not (suite_id or "").strip():
            gr.Warning("Run or pick a suite first.")
            return None
        try:
            exported = export_suite_files(history, host.backend, suite_id, title_note=host.label,
                                          concurrency=concurrency_results)
        except ValueError as e:
            gr.Warning(escape(str(e)))  # a toast shows HTML
            return None
        gr.Info(escape(f"Suite files in {exported.paths[0].parent} (replaced by the next suite export)"))
        return [str(p) for p in exported.paths]

    def suite_choices():
        ids = [r["suite_id"] for r in history.suites()]
        return gr.update(choices=ids), gr.update(choices=ids)

    def compare_suites(a, b):
        if not a or not b:
            return None, None, ""
        ab = ab_compare(runs_frame(history, a), runs_frame(history, b))
        return ab.round(3), ab_chart(ab, f"A {a}", f"B {b}"), ab_markdown(ab)

    # --- layout ----------------------------------------------------------------------------------------------------

    gr.Markdown("Run prompt suites on both engines (settings from the Run tab), sweep one variable, and see "
                "per category whether speculative decoding pays.")
    with gr.Row():
        suite_cats = gr.CheckboxGroup(suite_names(), value=["code"], label="Suites", elem_id="suite-categories")
        suite_file = gr.File(label="Or your own suite (JSONL / CSV)", file_types=[".jsonl", ".csv"], type="filepath")
    with gr.Row():
        suite_n = gr.Slider(1, 8, value=2, step=1, label="Prompts per suite", elem_id="suite-n")
        suite_repeats = gr.Slider(1, 5, value=1, step=1, label="Repeats", elem_id="suite-repeats",
                                  info="per prompt; 2+ measure the noise")
        suite_tokens = gr.Slider(8, 512, value=SUITE_MAX_NEW_TOKENS, step=8, label="Max new tokens",
                                 elem_id="suite-tokens")
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
        export_btn = gr.Button("Export suite (CSV + HTML report)", elem_id="export-suite")
    suite_files = gr.File(label="Suite files", file_count="multiple", elem_id="suite-files")
    gr.Markdown("### A/B of two suites")
    with gr.Row():
        ab_a = gr.Dropdown([], label="Suite A")
        ab_b = gr.Dropdown([], label="Suite B")
        ab_btn = gr.Button("Compare")
    ab_table = gr.Dataframe(interactive=False)
    ab_plot = gr.Plot()
    ab_text = gr.Markdown(elem_id="ab-conclusion")

    # --- events ----------------------------------------------------------------------------------------------------

    s = settings
    suite_inputs = [suite_cats, suite_file, suite_n, suite_tokens, sweep_var, sweep_vals, s.method, s.k, s.dynamic_k,
                    s.confidence, s.draft_vocab, s.fallback, s.top_p, s.seed, s.mode, suite_repeats]
    suite_outputs = [suite_status, suite_id_box, suite_table, suite_speed, suite_acc, suite_lat, suite_conc,
                     advice_md]
    # progress on one component each: Gradio's page re-reads every component any event showed progress on, on each
    # update of a run in the Run tab (docs/page-cost.md)
    suite_event = suite_btn.click(run_suite_ui, suite_inputs, suite_outputs, concurrency_limit=1,
                                  concurrency_id="engines", show_progress_on=[suite_status])
    suite_event.then(suite_choices, None, [ab_a, ab_b], show_progress_on=[ab_text])
    suite_stop.click(stop_suite, None, None, concurrency_limit=None)
    export_btn.click(export, suite_id_box, suite_files, concurrency_limit=1)  # see ExportFolder
    tab.select(suite_choices, None, [ab_a, ab_b], show_progress_on=[ab_text])
    ab_btn.click(compare_suites, [ab_a, ab_b], [ab_table, ab_plot, ab_text], show_progress_on=[ab_text])
