"""The Gradio console: the page's layout, what its tabs share, and the model-status line. Each tab is built by its
own module (tab_run, tab_history, tab_workbench); the work is done by runner, suite_job, render, charts, history."""

from __future__ import annotations

import logging
from html import escape
from pathlib import Path

import gradio as gr

from engine.limits import MAX_UPLOAD_BYTES
from engine.setup import setup
from specconsole import tab_history, tab_run, tab_workbench
from specconsole.frames import quiet_frames
from specconsole.history import History, HistoryError
from specconsole.host import ModelHost
from specconsole.run_layout import backend_view

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CSS = (ASSETS / "console.css").read_text()
PRESENTER_JS = (ASSETS / "presenter.js").read_text()  # ?view=present, the Presenter view button, Enter / Escape
QUEUE_POLL_S = 0.05  # how often Gradio's idle queue looks for a new job (its default, 1 ms, costs the engines CPU)
GRADIO_CACHE_SWEEP = (3600, 86400)  # (every s, files older than s) for Gradio's copies of served files


def build(host: ModelHost, history: History) -> gr.Blocks:
    setup()  # process-wide settings the engines need, for a page built without launch.py (engine.setup)
    # Gradio copies every file it serves (exports, uploads) into its own cache and keeps it: every hour, drop the
    # copies older than a day (and all of them when the console stops)
    with gr.Blocks(title="SpecConsole", delete_cache=GRADIO_CACHE_SWEEP) as app:
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
            return line, gr.Timer(active=not settled), *backend_view(host)

        timer.tick(model_status, outputs=[status, timer, *run.backend_outputs], show_progress="hidden",
                   show_progress_on=[status])
    return app


def launch(host: ModelHost, history: History, server_name: str, port: int, auth=None, prevent_thread_lock=False,
           share: bool = False):
    """Serve the page. `share` is always passed on: left to Gradio, GRADIO_SHARE or a hosted notebook would open a
    public link without the login check of launch.py."""
    app = build(host, history)
    app.queue(default_concurrency_limit=4)
    # Gradio's queue polls for new jobs every 1 ms and for progress every 10 ms while idle: each wake-up takes the GIL
    # and a core from the engines it shows; Gradio's own values on Windows, 50 and 100 ms, go unnoticed by a person.
    app._queue.sleep_when_free, app._queue.progress_update_sleep_when_free = QUEUE_POLL_S, 2 * QUEUE_POLL_S
    app.launch(server_name=server_name, server_port=port, auth=auth, css=CSS, js=PRESENTER_JS, show_error=True,
               prevent_thread_lock=prevent_thread_lock, footer_links=[], share=bool(share),
               max_file_size=MAX_UPLOAD_BYTES,  # a suite file over it is refused as it arrives
               # Gradio's own run history copies every prompt and output (the charts too) into the browser's
               # localStorage and rewrites all of its records twice a second while a run streams: the History tab
               # keeps the runs, and the browser's time belongs to the engines (docs/page-cost.md)
               run_history=False,
               app_kwargs={"middleware": [quiet_frames()]})
    return app


__all__ = ["build", "launch", "HistoryError"]
