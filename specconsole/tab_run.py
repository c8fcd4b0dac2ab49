"""The Run tab: one prompt on both engines, streamed side by side into two live panels, the figures and charts.

"Compare with" adds up to three more speculative configurations (specconsole.variants.PRESETS) to the run: each
gets a live panel of its own (pre-built, hidden until used), a row in the engines table under the figures and a
trace in each chart. On vLLM the choices are the extra speculative servers (one per --speculative-config,
`--vllm-compare`), not the presets.

Its drafting settings are shared with the Workbench (RunSettings). Settings the backend does not apply per request
(vLLM: the speculative server's config) are greyed out and say who sets them, once the backend is known."""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from html import escape
from pathlib import Path

import gradio as gr

from engine.backend import ENGINES, K_RANGE, MAX_EXTRA, Drafting, extra_engine
from engine.limits import DYNAMIC_K_MAX, MAX_QUEUED_RUNS, SettingsError
from engine.exact.models import ModelError
from engine.methods import METHODS
from engine.request import (DEFAULT_DRAFT_CONFIDENCE, DEFAULT_DYNAMIC_K, DEFAULT_FALLBACK, DEFAULT_K,
                            DEFAULT_MAX_NEW_TOKENS, DEFAULT_SEED, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, MAX_NEW_TOKENS,
                            MIN_DRAFT_VOCAB, Request, build_request)
from specconsole.history import History
from specconsole.host import ModelHost
from specconsole.markup import md
from specconsole.render import PanelFeed, legend_html, panel_notice
from specconsole.run_stream import figures_for, notices, outputs_of, stream
from specconsole.runner import MODES, Comparison, run_meta
from specconsole.suites import SuitePrompt, categories, load_suite
from specconsole.variants import PRESETS, Variant, choose, from_presets, label_of

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
LIVE_PANEL_JS = (ASSETS / "live_panel.js").read_text()
QUEUED = ("Queued behind another run: runs go one at a time, because the timings of concurrent runs would share "
          "the CPU. This one starts when that one ends (Stop cancels it).")
ONE_AT_A_TIME = ("Runs go one at a time (also across browser tabs): the timings of concurrent runs would share the "
                 "CPU, so a second Run waits for the first.")
TOO_MANY_QUEUED = (f"{MAX_QUEUED_RUNS} runs are already waiting for the engines (the most that may wait): press Run "
                   "again when one of them has started, or Stop one.")
# one run on the engines, MAX_QUEUED_RUNS waiting in run() for the lock, and one more handler that refuses the next:
# Gradio would otherwise hold further clicks in its own queue without a word
RUN_HANDLERS = MAX_QUEUED_RUNS + 2
METHOD_LABEL = "Drafting method"
EXTRA_ENGINES = [extra_engine(i) for i in range(MAX_EXTRA)]  # speculative-2 .. speculative-4: one hidden panel each


@dataclass
class RunSettings:
    """The Run tab's controls that the Workbench's suites also take."""
    method: gr.Radio
    k: gr.Slider
    dynamic_k: gr.Checkbox
    confidence: gr.Slider
    draft_vocab: gr.Number
    fallback: gr.Checkbox
    top_p: gr.Slider
    seed: gr.Number
    mode: gr.Radio
    show_rejected: gr.Checkbox


@dataclass
class RunForm:
    """The Run tab's inputs, in the order of its `inputs` list (as Gradio passes their values)."""
    prompt: str
    category: str
    method: str
    k: float
    dynamic_k: bool
    confidence: float
    draft_vocab: float | None
    fallback: bool
    temperature: float
    top_p: float
    max_new: float
    seed: float | None
    mode: str
    show_rejected: bool
    compare_with: list[str] | None

    def request(self) -> Request:
        return build_request(self.prompt, max_new_tokens=self.max_new, temperature=self.temperature,
                             top_p=self.top_p, seed=self.seed, method=self.method, k=self.k,
                             dynamic_k=self.dynamic_k, draft_confidence=self.confidence, fallback=self.fallback,
                             draft_vocab=self.draft_vocab)


@dataclass
class RunTab:
    settings: RunSettings
    run_event: object  # the Run button's event: the History tab refreshes after it
    backend_outputs: list  # what backend_view() updates once the models are ready


def examples(category: str) -> tuple[list[tuple[str, int]], SuitePrompt]:
    """The example list of a category's suite and its first prompt (ValueError: not one of the listed suites)."""
    prompts = load_suite(category)
    return [(f"{i + 1}. {p.prompt[:90]}", i) for i, p in enumerate(prompts)], prompts[0]


def extra_layout(labels: list[str]) -> list:
    """Show one extra panel per extra engine (headed by its label), hide the rest."""
    columns = [gr.update(visible=i < len(labels)) for i in range(MAX_EXTRA)]
    headings = [gr.update(value=f"**{md(labels[i])}** — speculative configuration {i + 2}")
                if i < len(labels) else gr.skip() for i in range(MAX_EXTRA)]
    return [*columns, *headings]


def live_panel(elem_id: str) -> gr.HTML:
    """A token panel that the Run tab grows in place: its value never changes, the panel feed fills it."""
    return gr.HTML("", html_template='<div class="live-panel"><div class="tokens"><span class="placeholder">'
                   'waiting for tokens…</span></div><div class="panel-error" hidden></div><div class="panel-status">'
                   '</div></div>', elem_id=elem_id)


def panel_feed() -> gr.HTML:
    """The one component every update of the token panels goes through (assets/live_panel.js)."""
    return gr.HTML("", html_template="<div></div>", js_on_load=LIVE_PANEL_JS, elem_id="panel-feed",
                   visible="hidden")


# Which control shows which of Request's drafting settings (engine.backend.DRAFTING_SETTINGS), in output order.
DRAFTING_CONTROLS = ("method", "k", "dynamic_k", "draft_confidence", "draft_vocab", "fallback")


def costs_markdown(costs: dict) -> str:
    """The policy's cost model (Backend.calibration()) in a sentence or two; "" where the backend has none."""
    if not costs:
        return ""
    curve = {int(m): v for m, v in costs["verify_ms"].items()}
    longest = max(curve)
    draft = costs.get("draft_ms_per_token")
    where = costs.get("machine", {}).get("cpu")
    return (f"Measured {md(costs.get('measured_at', '?'))}{f' on {md(where)}' if where else ''}: a plain target step "
            f"**{curve[1]:.1f} ms**, a pass over 5 tokens {curve.get(5, curve[longest]):.1f} ms, over {longest} "
            f"{curve[longest]:.1f} ms" + (f", a draft token **{draft:.1f} ms**" if draft is not None else "")
            + ". The policy drafts from these costs alone, never from a run's own timings: the page, `launch.py "
              "demo` and the benchmarks draft the same plan for the same request."
            + (" Other processes took the CPU while they were measured: they hold for this start only, and the next "
               "start measures them again." if costs.get("others_cores") else ""))


def k_range(host: ModelHost) -> tuple[int, int]:
    """The K the page's sliders offer: the backend's (Capabilities.k_range), engine.limits' until it is loaded."""
    return host.backend.capabilities.k_range if host.backend is not None else K_RANGE


def backend_view(host: ModelHost) -> list:
    """Updates for the drafting controls, the speculative server's section and "Compare with", from the backend's
    capabilities: a setting the backend does not apply is greyed out and says who sets it, rather than silently
    ignored; the K sliders span the K it drafts; a backend with its own speculative servers offers those to compare
    with."""
    backend = host.backend
    if backend is None:
        return [gr.skip()] * (len(DRAFTING_CONTROLS) + 6)
    ignored = set(backend.ignored_settings(build_request("-", method=host.method)))
    who = f"not applied: set by the speculative server ({backend.describe().get('method')})"
    updates = [gr.update(interactive=False, info=who) if name in ignored
               else gr.update(interactive=True) for name in DRAFTING_CONTROLS]
    low, high = backend.capabilities.k_range
    updates[DRAFTING_CONTROLS.index("k")].update(minimum=low, maximum=high)
    costs = costs_markdown(backend.calibration())
    served = backend.drafting()
    methods = backend.capabilities.methods
    server_method = gr.update(choices=list(methods), value=served.method if served and served.method in methods
                              else None) if methods else gr.skip()
    server_k = gr.update(minimum=low, maximum=high, **({"value": served.k} if served and served.k else {}))
    return [*updates, gr.update(visible=backend.capabilities.can_reconfigure), server_method, server_k,
            compare_choices(backend), gr.update(visible=bool(costs)), costs or gr.skip()]


def compare_choices(backend):
    """"Compare with" for this backend: the presets (local), or the backend's own extra servers (vLLM, llama.cpp)."""
    if not backend.capabilities.fixed_variants:
        return gr.skip()
    labels = [v["label"] for v in backend.variants().values()]
    if labels:
        return gr.update(choices=labels, value=[], interactive=True,
                         info="the backend's extra speculative servers, each with its own drafting")
    return gr.update(choices=[], value=[], interactive=False,
                     info="no extra speculative servers: start the console with e.g. `--vllm-compare "
                          "ngram:k=2,ngram:k=6` or `--llamacpp-compare draft:k=2` (or attach more: `--vllm-attach "
                          "BASE,SPEC,SPEC2,...`, `--llamacpp-attach ...`)")


def build(app: gr.Blocks, host: ModelHost, history: History) -> RunTab:
    active: dict[str, Comparison] = {}  # session -> its running comparison, for Stop
    queued: dict[str, threading.Event] = {}  # session -> set by Stop while its run waits for another one

    def variants(form: RunForm):
        """The run's request and its speculative configurations (the main one, then the extra ones), checked;
        raises SettingsError, ModelError or ValueError with the reason."""
        req = form.request()
        host.backend.validate(req)  # before anything runs or is saved
        # vLLM, llama.cpp: "Compare with" lists the backend's own extra servers; local: the drafting presets
        drafting = {"method": form.method} | ({"dynamic_k": True} if form.dynamic_k else {"k": int(form.k)})
        label = label_of(drafting, form.method)
        presets = lambda: [Variant(label, req), *from_presets(req, form.compare_with)]
        speculative, *extra = choose(host.backend, req, presets, form.compare_with or [])
        for v in extra:
            host.backend.validate(v.request)
        return req, speculative, extra

    def plan(*values):
        """Before a run: show the extra panels it will use, headed by their labels, and hide the others (an event of
        its own, so that the run's many updates need not name these components)."""
        try:
            extra = variants(RunForm(*values))[2] if host.ready else []
        except (SettingsError, ModelError, ValueError):
            extra = []  # the run says why
        return extra_layout([v.label for v in extra])

    def run(prompt, category, method, k, dynamic_k, confidence, draft_vocab, fallback, temperature, top_p, max_new,
            seed, mode, show_rejected, compare_with, request: gr.Request):
        form = RunForm(prompt, category, method, k, dynamic_k, confidence, draft_vocab, fallback, temperature, top_p,
                       max_new, seed, mode, show_rejected, compare_with)
        session = request.session_hash if request else "local"
        panel_run = uuid.uuid4().hex[:8]  # tells the page's panels that a new run starts
        if not host.ready:
            msg = host.status() if host.error else f"{host.status()}. Press Run again when the models are ready."
            yield outputs_of(notices(ENGINES, panel_notice(panel_run, msg)), "")
            return
        try:
            req, speculative, extra = variants(form)
        except (SettingsError, ModelError, ValueError) as e:
            yield outputs_of(notices(ENGINES, panel_notice(panel_run, str(e))), "")
            return
        engines = [*ENGINES, *EXTRA_ENGINES[:len(extra)]]
        # One comparison at a time (the Run button allows several handlers so that a waiting one can say so): two
        # at once would share the CPU, and the timings of both would be wrong.
        if not host.lock.acquire(blocking=False):
            if len(queued) >= MAX_QUEUED_RUNS and session not in queued:
                yield outputs_of(notices(ENGINES, panel_notice(panel_run, TOO_MANY_QUEUED)), "")
                return
            stopped = queued[session] = threading.Event()
            yield outputs_of(notices(engines, PanelFeed(panel_run).message([], QUEUED)),
                             f'<div class="status-line">{escape(QUEUED)}</div>')
            try:
                while not host.lock.acquire(timeout=1.0):
                    if stopped.is_set():
                        note = PanelFeed(panel_run).message([], "Stopped before it started.")
                        yield outputs_of(notices(engines, note), "")
                        return
                    yield outputs_of()  # gives gradio the chance to drop the run of a page that was closed
            finally:
                queued.pop(session, None)
        try:
            comp = Comparison(host.backend, req, form.mode, history,
                              run_meta(host.backend, req) | {"category": form.category},
                              extra=extra, label=speculative.label)
            active[session] = comp
            try:
                yield from stream(comp, panel_run, form.mode, form.show_rejected)  # starts it
            finally:
                comp.cancel.set()  # a closed tab or an error must not leave the engines running
                active.pop(session, None)
        finally:
            host.lock.release()
        if comp.save_error:
            gr.Warning(escape(comp.save_error))  # a toast shows HTML

    def reconfigure_server(method, k, draft):
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

    def measure_costs():
        if not host.ready:
            return gr.skip()
        with host.lock:  # never while a run is timed
            return costs_markdown(host.backend.recalibrate())

    def stop(request: gr.Request):
        session = request.session_hash if request else "local"
        comp = active.get(session)
        if comp:
            comp.cancel.set()
        if session in queued:
            queued[session].set()

    def pick_category(category):
        try:
            choices, first = examples(category)
        except ValueError as e:  # not one of the listed suites
            gr.Warning(escape(str(e)))  # a toast shows HTML
            return gr.skip(), gr.skip(), gr.skip()
        return gr.update(choices=choices, value=0), first.prompt, first.temperature

    def pick_example(category, index):
        if index is None:
            return gr.skip(), gr.skip()
        try:
            item = load_suite(category)[int(index)]
        except (ValueError, IndexError) as e:
            gr.Warning(escape(str(e)))
            return gr.skip(), gr.skip()
        return item.prompt, item.temperature

    # --- layout ----------------------------------------------------------------------------------------------------

    k_low, k_high = k_range(host)  # backend_view sets the backend's once it is loaded
    k_default = min(max(DEFAULT_K, k_low), k_high)
    cats = categories()
    with gr.Row(elem_classes="present-hide"):  # the presenter view keeps the panels, legend and headline figures
        with gr.Column(scale=3):
            category = gr.Dropdown(cats, value=cats[0] if cats else None, label="Category")
            # the first category's first example is in the page as it is served: an event on load that filled it
            # in would overwrite what someone typed (or a test set) before it came back
            try:
                choices, first = examples(cats[0]) if cats else ([], None)
            except ValueError:
                choices, first = [], None
            example = gr.Dropdown(choices, value=0 if choices else None, label="Example prompt",
                                  allow_custom_value=False)
            prompt = gr.Textbox(first.prompt if first else "", label="Prompt", lines=6, elem_id="prompt")
            with gr.Row():
                run_btn = gr.Button("Run", variant="primary", elem_id="run")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
            gr.Markdown(ONE_AT_A_TIME, elem_id="one-at-a-time")
        with gr.Column(scale=2):
            gr.Markdown(f"Backend: **{md(host.label)}**")
            # shown once the backend says it can restart its speculative side, with its methods (backend_view)
            with gr.Accordion("Speculative server (vLLM, llama.cpp: started by the console)", open=False,
                              visible=False, elem_id="server-drafting") as server_section:
                server_method = gr.Dropdown([], label="Method")
                server_k = gr.Slider(k_low, k_high, value=k_default, step=1, label="K (draft tokens per step)")
                server_draft = gr.Textbox(label="Draft model path (methods that load one; empty: the one loaded)")
                server_apply = gr.Button("Apply (restarts the speculative server)")
                server_status = gr.Markdown()
            # shown once the backend says its policy drafts from a cost model of ours (backend_view)
            with gr.Accordion("The policy's cost model", open=False, visible=False,
                              elem_id="cost-model") as costs_section:
                costs_text = gr.Markdown(elem_id="cost-model-text")
                costs_measure = gr.Button("Measure again (a few seconds; waits for a run to end)", size="sm")
            method = gr.Radio(list(METHODS), value=host.method, label=METHOD_LABEL)
            with gr.Row():
                k = gr.Slider(k_low, k_high, value=k_default, step=1, label="K (draft tokens per step)")
                dynamic_k = gr.Checkbox(
                    value=DEFAULT_DYNAMIC_K, label="Dynamic K",
                    info="draft model: keeps drafting while one more token is expected to pay "
                         f"(up to {DYNAMIC_K_MAX}, or K if higher); n-gram: K from the measured costs")
            with gr.Row():
                confidence = gr.Slider(0.0, 0.95, value=DEFAULT_DRAFT_CONFIDENCE, step=0.05,
                                       label="Draft stops below confidence")
                draft_vocab = gr.Number(value=0, precision=0, minimum=0, label="Draft vocabulary (FR-Spec, 0 = full)",
                                        info="the draft model drafts among its N most frequent tokens only "
                                             f"(N >= {MIN_DRAFT_VOCAB}); the target still checks every token")
            with gr.Row():
                fallback = gr.Checkbox(value=DEFAULT_FALLBACK, label="Fall back to plain decoding when it does not pay")
            with gr.Row():
                temperature = gr.Slider(0.0, 1.5, value=first.temperature if first else DEFAULT_TEMPERATURE, step=0.05,
                                        label="Temperature (0 = greedy)", elem_id="temperature")
                top_p = gr.Slider(0.05, 1.0, value=DEFAULT_TOP_P, step=0.05, label="Top-p")
            with gr.Row():
                max_new = gr.Slider(1, MAX_NEW_TOKENS, value=DEFAULT_MAX_NEW_TOKENS, step=1, label="Max new tokens",
                                    elem_id="max-new")
                seed = gr.Number(value=DEFAULT_SEED, precision=0, label="Seed")
            with gr.Row():
                mode = gr.Radio(list(MODES), value="fair", label="Mode",
                                info="fair: engines take turns, each timed alone; race: all engines at once, "
                                     "sharing the machine (so each runs slower than it would alone)")
                show_rejected = gr.Checkbox(value=True, label="Show rejected drafts")
            compare_with = gr.CheckboxGroup(
                list(PRESETS), value=[], label="Compare with", elem_id="compare-with",
                info=f"up to {MAX_EXTRA} more speculative configurations in the same run (same prompt and "
                     "sampling), each in a panel of its own (on vLLM: its extra speculative servers)")
    with gr.Row():
        gr.HTML(legend_html())
        # assets/presenter.js: switches the page's layout only, so a run goes on across the switch
        gr.Button("Presenter view", elem_id="present-toggle", size="sm", scale=0).click(
            None, js="() => window.specconsolePresent()")
    with gr.Row(equal_height=True):
        with gr.Column():
            gr.Markdown("**Baseline** — target only, one token per pass")
            live_panel("baseline-panel")
        with gr.Column():
            gr.Markdown("**Speculative** — draft proposes, target verifies")
            live_panel("speculative-panel")
    # the extra engines of an N-way run (Compare with): built now, shown by the run that uses them
    extra_columns, extra_headings = [], []
    with gr.Row(equal_height=True):
        for engine in EXTRA_ENGINES:
            with gr.Column(visible=False) as column:
                extra_headings.append(gr.Markdown(f"**{engine}**"))
                live_panel(f"{engine}-panel")
            extra_columns.append(column)
    feed = panel_feed()
    figures = gr.HTML("", elem_id="figures")
    empty = figures_for({})  # also loads plotly's templates now rather than during the first run
    with gr.Row(elem_classes="present-hide"):
        chart_steps = gr.Plot(empty[0], label="Acceptance per step", elem_id="chart-steps")
        chart_pos = gr.Plot(empty[1], label="Per-position acceptance", elem_id="chart-positions")
        chart_tokens = gr.Plot(empty[2], label="Tokens over time", elem_id="chart-tokens")
    with gr.Row(elem_classes="present-hide"):  # the page's width: a bar per target pass
        chart_time = gr.Plot(empty[3], label="Where the time went", elem_id="chart-time")

    # --- events ----------------------------------------------------------------------------------------------------

    inputs = [prompt, category, method, k, dynamic_k, confidence, draft_vocab, fallback, temperature, top_p, max_new,
              seed, mode, show_rejected, compare_with]
    # in outputs_of()'s order
    outputs = [feed, figures, chart_steps, chart_pos, chart_tokens, chart_time]
    # no progress overlay: its animation would cost the browser CPU during the very run it shows
    # RUN_HANDLERS handlers: one runs, the others wait in run() for host.lock and say that they are queued
    # Gradio's page re-reads (get_data), on every update of a run, each component any event showed progress on, the
    # charts among them: every event names one small component to show progress on (docs/page-cost.md)
    layout_event = run_btn.click(plan, inputs, [*extra_columns, *extra_headings], queue=False, show_progress="hidden",
                                 show_progress_on=[feed])
    run_event = layout_event.then(run, inputs, outputs, concurrency_limit=RUN_HANDLERS, concurrency_id="runs",
                                  show_progress="hidden", show_progress_on=[feed])
    stop_btn.click(stop, None, None, concurrency_limit=None)
    category.change(pick_category, category, [example, prompt, temperature], show_progress_on=[example])
    example.input(pick_example, [category, example], [prompt, temperature], show_progress_on=[example])
    costs_measure.click(measure_costs, None, costs_text, concurrency_limit=1, concurrency_id="engines")
    server_apply.click(reconfigure_server, [server_method, server_k, server_draft], server_status,
                       concurrency_limit=1, concurrency_id="engines")

    settings = RunSettings(method, k, dynamic_k, confidence, draft_vocab, fallback, top_p, seed, mode, show_rejected)
    return RunTab(settings, run_event, [method, k, dynamic_k, confidence, draft_vocab, fallback, server_section,
                                        server_method, server_k, compare_with, costs_section, costs_text])
