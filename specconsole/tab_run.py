"""The Run tab: one prompt on both engines, streamed side by side into two live panels, the figures and charts.

"Compare with" adds up to three more speculative configurations (specconsole.variants.PRESETS) to the run: each
gets a live panel of its own (pre-built, hidden until used), a row in the engines table under the figures and a
trace in each chart. On vLLM the choices are the extra speculative servers (one per --speculative-config,
`--vllm-compare`), not the presets.

Its drafting settings are shared with the Workbench (RunSettings). Settings the backend does not apply per request
(vLLM: the speculative server's config) are greyed out and say who sets them, once the backend is known.

The tab by concern: run_layout (its components, and what they show for a backend), run_form (the form as one value),
run_queue (one run at a time), and here what its events do (Handlers) and which event calls what (build)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from html import escape
from pathlib import Path

import gradio as gr

from engine.backend import ENGINES
from engine.drafting import Drafting
from engine.exact.models import ModelError
from engine.limits import MAX_QUEUED_RUNS, SettingsError
from specconsole.history import History
from specconsole.host import ModelHost
from specconsole.markup import md
from specconsole.render import panel_notice
from specconsole.run_form import RunForm
from specconsole.run_layout import EXTRA_ENGINES, RunSettings, costs_markdown, examples, extra_layout, layout
from specconsole.run_queue import RunQueue
from specconsole.run_stream import notices, outputs_of, stream
from specconsole.runner import Comparison, run_meta
from specconsole.suites import load_suite

log = logging.getLogger(__name__)

# one run on the engines, MAX_QUEUED_RUNS waiting in run() for the lock, and one more handler that refuses the next:
# Gradio would otherwise hold further clicks in its own queue without a word
RUN_HANDLERS = MAX_QUEUED_RUNS + 2


@dataclass
class RunTab:
    settings: RunSettings
    run_event: object  # the Run button's event: the History tab refreshes after it
    backend_outputs: list  # what run_layout.backend_view() updates once the models are ready


class Handlers:
    """What the tab's events do. The form's values arrive in RunForm's order (RunControls.inputs())."""

    def __init__(self, host: ModelHost, history: History):
        self.host, self.history = host, history
        self.queue = RunQueue(host.lock)

    def plan(self, *values):
        """Before a run: show the extra panels it will use, headed by their labels, and hide the others (an event of
        its own, so that the run's many updates need not name these components)."""
        try:
            extra = RunForm(*values).engines(self.host.backend)[2] if self.host.ready else []
        except (SettingsError, ModelError, ValueError):
            extra = []  # the run says why
        return extra_layout([v.label for v in extra])

    def run(self, prompt, category, method, k, dynamic_k, confidence, draft_vocab, fallback, temperature, top_p,
            max_new, seed, mode, show_rejected, compare_with, request: gr.Request):
        # named one by one, not *values: they are the names of the page's `/run` API (gradio_client, "Use via API")
        form = RunForm(prompt, category, method, k, dynamic_k, confidence, draft_vocab, fallback, temperature, top_p,
                       max_new, seed, mode, show_rejected, compare_with)
        host = self.host
        session = request.session_hash if request else "local"
        panel_run = uuid.uuid4().hex[:8]  # tells the page's panels that a new run starts
        if not host.ready:
            msg = host.status() if host.error else f"{host.status()}. Press Run again when the models are ready."
            yield outputs_of(notices(ENGINES, panel_notice(panel_run, msg)), "")
            return
        try:
            req, speculative, extra = form.engines(host.backend)
        except (SettingsError, ModelError, ValueError) as e:
            yield outputs_of(notices(ENGINES, panel_notice(panel_run, str(e))), "")
            return
        engines = [*ENGINES, *EXTRA_ENGINES[:len(extra)]]
        if not (yield from self.queue.take_turn(session, panel_run, engines)):
            return

        def start() -> Comparison:  # inside the turn: whatever fails here (a dead engine process) frees the engines
            meta = run_meta(host.backend, req) | {"category": form.category}
            return Comparison(host.backend, req, form.mode, self.history, meta, extra=extra, label=speculative.label)

        with self.queue.run(session, start) as comp:
            yield from stream(comp, panel_run, form.mode, form.show_rejected)  # starts it
        if comp.save_error:
            gr.Warning(escape(comp.save_error))  # a toast shows HTML

    def stop(self, request: gr.Request):
        self.queue.stop(request.session_hash if request else "local")

    def reconfigure_server(self, method, k, draft):
        host = self.host
        if not host.ready or not host.backend.capabilities.can_reconfigure:
            return "Only servers the console started (`--backend vllm` or `llamacpp`) can be restarted from here."
        if not method:
            return "Pick a method first."
        try:
            with host.lock:
                host.backend.reconfigure(Drafting(method, int(k), draft.strip() or None))
        except (RuntimeError, ValueError) as e:  # VLLMError, LlamaCppError, SettingsError: the old server runs again
            return f"Could not apply: {md(e)}"
        served = host.backend.drafting()
        return f"Speculative server running with {md(served.method)}, K={served.k}" + (
            f", draft {md(Path(served.draft).name)}" if served.draft else "") + "."

    def measure_costs(self):
        if not self.host.ready:
            return gr.skip()
        with self.host.lock:  # never while a run is timed
            return costs_markdown(self.host.backend.recalibrate())

    @staticmethod
    def pick_category(category):
        try:
            choices, first = examples(category)
        except ValueError as e:  # not one of the listed suites
            gr.Warning(escape(str(e)))  # a toast shows HTML
            return gr.skip(), gr.skip(), gr.skip()
        return gr.update(choices=choices, value=0), first.prompt, first.temperature

    @staticmethod
    def pick_example(category, index):
        if index is None:
            return gr.skip(), gr.skip()
        try:
            item = load_suite(category)[int(index)]
        except (ValueError, IndexError) as e:
            gr.Warning(escape(str(e)))
            return gr.skip(), gr.skip()
        return item.prompt, item.temperature


def build(app: gr.Blocks, host: ModelHost, history: History) -> RunTab:
    """The tab's layout, and which of its events calls which handler."""
    c, h = layout(host), Handlers(host, history)
    inputs = c.inputs()
    # no progress overlay: its animation would cost the browser CPU during the very run it shows. Gradio's page
    # re-reads (get_data), on every update of a run, each component any event showed progress on, the charts among
    # them: every event names one small component to show progress on (docs/page-cost.md)
    layout_event = c.run.click(h.plan, inputs, [*c.extra_columns, *c.extra_headings], queue=False,
                               show_progress="hidden", show_progress_on=[c.feed])
    # RUN_HANDLERS handlers: one runs, the others wait in run() for their turn and say that they are queued
    run_event = layout_event.then(h.run, inputs, c.outputs(), concurrency_limit=RUN_HANDLERS, concurrency_id="runs",
                                  show_progress="hidden", show_progress_on=[c.feed])
    c.stop.click(h.stop, None, None, concurrency_limit=None)
    c.category.change(h.pick_category, c.category, [c.example, c.prompt, c.temperature], show_progress_on=[c.example])
    c.example.input(h.pick_example, [c.category, c.example], [c.prompt, c.temperature], show_progress_on=[c.example])
    c.costs.measure.click(h.measure_costs, None, c.costs.text, concurrency_limit=1, concurrency_id="engines")
    c.server.apply.click(h.reconfigure_server, [c.server.method, c.server.k, c.server.draft], c.server.status,
                         concurrency_limit=1, concurrency_id="engines")
    return RunTab(c.settings, run_event, c.backend_outputs())
