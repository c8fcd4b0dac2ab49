"""The Run tab's layout: its controls, token panels, figures and charts (RunControls), and what the drafting controls
show once the backend is known (backend_view): a setting the backend does not apply is greyed out and says who sets
it, the K sliders span the K it drafts, and "Compare with" offers its own servers where it has them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import gradio as gr

from engine.backend import K_RANGE, MAX_EXTRA, extra_engine
from engine.drafting import MIN_DRAFT_VOCAB
from engine.limits import DYNAMIC_K_MAX
from engine.methods import METHODS
from engine.request import (DEFAULT_DRAFT_CONFIDENCE, DEFAULT_DYNAMIC_K, DEFAULT_FALLBACK, DEFAULT_K,
                            DEFAULT_MAX_NEW_TOKENS, DEFAULT_SEED, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, MAX_NEW_TOKENS,
                            build_request)
from specconsole.host import ModelHost
from specconsole.markup import md
from specconsole.render import legend_html
from specconsole.run_form import RunForm
from specconsole.run_stream import figures_for
from specconsole.runner import MODES
from specconsole.suites import SuitePrompt, categories, load_suite
from specconsole.variants import PRESETS

ASSETS = Path(__file__).resolve().parent.parent / "assets"
LIVE_PANEL_JS = (ASSETS / "live_panel.js").read_text()
ONE_AT_A_TIME = ("Runs go one at a time (also across browser tabs): the timings of concurrent runs would share the "
                 "CPU, so a second Run waits for the first.")
METHOD_LABEL = "Drafting method"
EXTRA_ENGINES = [extra_engine(i) for i in range(MAX_EXTRA)]  # speculative-2 .. speculative-4: one hidden panel each
# Which control shows which of the request's drafting settings (engine.drafting.DRAFTING_SETTINGS), in output order.
DRAFTING_CONTROLS = ("method", "k", "dynamic_k", "draft_confidence", "draft_vocab", "fallback")


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
class ServerControls:
    """Restarting a speculative server the console started, with other drafting (shown where the backend can)."""
    section: gr.Accordion
    method: gr.Dropdown
    k: gr.Slider
    draft: gr.Textbox
    apply: gr.Button
    status: gr.Markdown


@dataclass
class CostControls:
    """The policy's cost model, and a button to measure it again (shown where our policy drafts)."""
    section: gr.Accordion
    text: gr.Markdown
    measure: gr.Button


@dataclass
class RunControls:
    """Every component the Run tab's handlers read or update."""
    prompt: gr.Textbox
    category: gr.Dropdown
    example: gr.Dropdown
    run: gr.Button
    stop: gr.Button
    server: ServerControls
    costs: CostControls
    settings: RunSettings
    temperature: gr.Slider
    max_new: gr.Slider
    compare_with: gr.CheckboxGroup
    extra_columns: list[gr.Column]  # one per extra engine of an N-way run, hidden until a run uses it
    extra_headings: list[gr.Markdown]
    feed: gr.HTML  # every update of the token panels goes through it (assets/live_panel.js)
    figures: gr.HTML
    charts: list[gr.Plot]  # in run_stream.outputs_of()'s order

    def inputs(self) -> list:
        """The form's controls, in RunForm's order."""
        return [getattr(self if hasattr(self, f.name) else self.settings, f.name) for f in fields(RunForm)]

    def outputs(self) -> list:
        """What a run updates, in run_stream.outputs_of()'s order."""
        return [self.feed, self.figures, *self.charts]

    def backend_outputs(self) -> list:
        """What backend_view() updates, in its order."""
        s = self.settings
        return [s.method, s.k, s.dynamic_k, s.confidence, s.draft_vocab, s.fallback, self.server.section,
                self.server.method, self.server.k, self.compare_with, self.costs.section, self.costs.text]


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


def k_range(host: ModelHost) -> tuple[int, int]:
    """The K the page's sliders offer: the backend's (Capabilities.k_range), engine.limits' until it is loaded."""
    return host.backend.capabilities.k_range if host.backend is not None else K_RANGE


def layout(host: ModelHost) -> RunControls:
    """The tab's components, in page order: the prompt and the settings side by side (hidden in the presenter view),
    the legend, the token panels, the figures and the charts."""
    with gr.Row(elem_classes="present-hide"):  # the presenter view keeps the panels, legend and headline figures
        with gr.Column(scale=3):
            prompt, category, example, run, stop, first_temperature = _prompt_column()
        with gr.Column(scale=2):
            gr.Markdown(f"Backend: **{md(host.label)}**")
            server, costs = _server_section(host), _costs_section()
            settings, temperature, max_new, compare_with = _settings(host, first_temperature)
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
        charts = [gr.Plot(empty[0], label="Acceptance per step", elem_id="chart-steps"),
                  gr.Plot(empty[1], label="Per-position acceptance", elem_id="chart-positions"),
                  gr.Plot(empty[2], label="Tokens over time", elem_id="chart-tokens")]
    with gr.Row(elem_classes="present-hide"):  # the page's width: a bar per target pass
        charts.append(gr.Plot(empty[3], label="Where the time went", elem_id="chart-time"))
    return RunControls(prompt, category, example, run, stop, server, costs, settings, temperature, max_new,
                       compare_with, extra_columns, extra_headings, feed, figures, charts)


def _prompt_column():
    cats = categories()
    category = gr.Dropdown(cats, value=cats[0] if cats else None, label="Category")
    # the first category's first example is in the page as it is served: an event on load that filled it in would
    # overwrite what someone typed (or a test set) before it came back
    try:
        choices, first = examples(cats[0]) if cats else ([], None)
    except ValueError:
        choices, first = [], None
    example = gr.Dropdown(choices, value=0 if choices else None, label="Example prompt", allow_custom_value=False)
    prompt = gr.Textbox(first.prompt if first else "", label="Prompt", lines=6, elem_id="prompt")
    with gr.Row():
        run = gr.Button("Run", variant="primary", elem_id="run")
        stop = gr.Button("Stop", variant="stop", elem_id="stop")
    gr.Markdown(ONE_AT_A_TIME, elem_id="one-at-a-time")
    return prompt, category, example, run, stop, first.temperature if first else DEFAULT_TEMPERATURE


def _server_section(host: ModelHost) -> ServerControls:
    """Shown once the backend says it can restart its speculative side, with its methods (backend_view)."""
    k_low, k_high = k_range(host)  # backend_view sets the backend's once it is loaded
    with gr.Accordion("Speculative server (vLLM, llama.cpp: started by the console)", open=False, visible=False,
                      elem_id="server-drafting") as section:
        method = gr.Dropdown([], label="Method")
        k = gr.Slider(k_low, k_high, value=min(max(DEFAULT_K, k_low), k_high), step=1,
                      label="K (draft tokens per step)")
        draft = gr.Textbox(label="Draft model path (methods that load one; empty: the one loaded)")
        apply = gr.Button("Apply (restarts the speculative server)")
        status = gr.Markdown()
    return ServerControls(section, method, k, draft, apply, status)


def _costs_section() -> CostControls:
    """Shown once the backend says its policy drafts from a cost model of ours (backend_view)."""
    with gr.Accordion("The policy's cost model", open=False, visible=False, elem_id="cost-model") as section:
        text = gr.Markdown(elem_id="cost-model-text")
        measure = gr.Button("Measure again (a few seconds; waits for a run to end)", size="sm")
    return CostControls(section, text, measure)


def _settings(host: ModelHost, temperature: float):
    """The drafting and sampling settings; `temperature`: the first example's."""
    k_low, k_high = k_range(host)
    method = gr.Radio(list(METHODS), value=host.method, label=METHOD_LABEL)
    with gr.Row():
        k = gr.Slider(k_low, k_high, value=min(max(DEFAULT_K, k_low), k_high), step=1,
                      label="K (draft tokens per step)")
        dynamic_k = gr.Checkbox(value=DEFAULT_DYNAMIC_K, label="Dynamic K",
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
        temperature = gr.Slider(0.0, 1.5, value=temperature, step=0.05, label="Temperature (0 = greedy)",
                                elem_id="temperature")
        top_p = gr.Slider(0.05, 1.0, value=DEFAULT_TOP_P, step=0.05, label="Top-p")
    with gr.Row():
        max_new = gr.Slider(1, MAX_NEW_TOKENS, value=DEFAULT_MAX_NEW_TOKENS, step=1, label="Max new tokens",
                            elem_id="max-new")
        seed = gr.Number(value=DEFAULT_SEED, precision=0, label="Seed")
    with gr.Row():
        mode = gr.Radio(list(MODES), value="fair", label="Mode",
                        info="fair: engines take turns, each timed alone; race: all engines at once, sharing the "
                             "machine (so each runs slower than it would alone)")
        show_rejected = gr.Checkbox(value=True, label="Show rejected drafts")
    compare_with = gr.CheckboxGroup(
        list(PRESETS), value=[], label="Compare with", elem_id="compare-with",
        info=f"up to {MAX_EXTRA} more speculative configurations in the same run (same prompt and sampling), each in "
             "a panel of its own (on vLLM: its extra speculative servers)")
    settings = RunSettings(method, k, dynamic_k, confidence, draft_vocab, fallback, top_p, seed, mode, show_rejected)
    return settings, temperature, max_new, compare_with


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


def backend_view(host: ModelHost) -> list:
    """Updates for RunControls.backend_outputs(), from the backend's capabilities (nothing until it is loaded)."""
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
