"""The Gradio console: the page's layout, what its tabs share, and the model-status line. Each tab is built by its
own module (tab_run, tab_history, tab_workbench); the work is done by runner, suite_job, render, charts, history."""

from __future__ import annotations

import logging
from html import escape
from pathlib import Path

import gradio as gr

from specconsole import tab_history, tab_run, tab_workbench
from specconsole.history import History, HistoryError
from specconsole.host import ModelHost

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CSS = (ASSETS / "console.css").read_text()
PRESENTER_JS = (ASSETS / "presenter.js").read_text()  # ?view=present, the Presenter view button, Enter / Escape


def build(host: ModelHost, history: History) -> gr.Blocks:
    with gr.Blocks(title="SpecConsole") as app:
        gr.Markdown("## SpecConsole — speculative decoding, side by side", elem_classes="present-hide")
        status = gr.HTML(f'<div class="status-line">{escape(host.status())}</div>', elem_id="model-status")
        timer = gr.Timer(1.0)
        with gr.Tab("Run"):
            run = tab_run.build(app, host, history)
        with gr.Tab("History", elem_id="history-tab") as history_tab:
            tab_history.build(history, history_tab, run.settings.show_rejected, run.run_event)
        with gr.Tab("Workbench", elem_id="workbench-tab") as workbench_tab:
            tab_workbench.build(host, history, workbench_tab, run.settings)

        def model_status():
            """Until the models are ready (or failed); then the Run tab shows what the backend applies, and the page
            stops asking."""
            settled = host.ready or host.error is not None
            line = f'<div class="status-line">{escape(host.status())}</div>'
            return line, gr.Timer(active=not settled), *tab_run.backend_view(host)

        timer.tick(model_status, outputs=[status, timer, *run.backend_outputs], show_progress="hidden")
    return app


def launch(host: ModelHost, history: History, server_name: str, port: int, auth=None, prevent_thread_lock=False):
    app = build(host, history)
    app.queue(default_concurrency_limit=4)
    return app.launch(server_name=server_name, server_port=port, auth=auth, css=CSS, js=PRESENTER_JS, show_error=True,
                      prevent_thread_lock=prevent_thread_lock, footer_links=[])


__all__ = ["build", "launch", "HistoryError"]
