"""One run's updates to the page, and when they go: what the Run tab's handler yields while a comparison runs.

The page must not take the CPU it measures, so updates are throttled (panels, figures and charts each at their own
pace), and in fair mode each next timed pass waits until the last update was handed over to Gradio (hand_over,
runner.Comparison.page_idle). This is the page's whole timing code (docs/page-cost.md measures each piece)."""

from __future__ import annotations

import json
import time
from html import escape

import gradio as gr

from engine.backend import ENGINES
from engine.metrics import IDLE_CHECK_PASSES, speculation_idle
from specconsole import charts
from specconsole.render import PanelFeed, engines_html, figures_html
from specconsole.runner import Comparison

# The page must not take the CPU it measures (the browser runs on the engines' cores, during their timed passes):
# panels receive only their new tokens; the browser's work per update grows with the panels it appends to, so the
# panels update every PANEL_S_PER_ENGINE per engine shown (0.3 s for two, 0.75 s for five); the figures once a
# second; plotly re-lays out a whole chart per update, the browser's largest cost (docs/page-cost.md), so charts
# every 10 s and at the end.
PANEL_S_PER_ENGINE = 0.15
# where every update lands in an engine's timed run, fewer: the browser's work grows with the updates, not with their
# tokens. Engines at once (race mode, servers that own their cores): at most two a second. Fair turns of a whole run
# each (llama.cpp and vLLM servers sharing the cores): one every PANEL_IN_WHOLE_RUN_S, so that the figures the page
# shows are the ones to quote: at two a second llama.cpp's plain server ran at 0.95 of its API speed in the page, its
# two threads filling both cores (docs/page-cost.md, "A whole run timed in the page")
PANEL_WHILE_TIMED_S = 0.5
PANEL_IN_WHOLE_RUN_S = 2.5
FIGURES_EVERY_S = 1.0
CHART_EVERY_S = 10.0
SETTLE_S = 0.05  # after an update is handed to Gradio, before the next timed pass may start
CHARTS = 4  # how many figures_for() returns, in a run's outputs after the feed and the figures

def rolling_acceptance(result, window: int = 8) -> float | None:
    steps = [s for s in result.steps if s.drafted > 0][-window:]
    drafted = sum(s.drafted for s in steps)
    return sum(s.accepted for s in steps) / drafted if drafted else None


def figures_for(results: dict, labels: dict | None = None):
    """The four charts; extra speculative engines (an N-way run) add a trace (the time chart: a row) each, named by
    `labels`."""
    b, s = results.get("baseline"), results.get("speculative")
    others = {(labels or {}).get(e, e): r for e, r in results.items() if e not in ENGINES}
    return (charts.acceptance_per_step(s, others), charts.per_position(s, others),
            charts.tokens_over_time(b, s, others), charts.time_per_pass(b, s, others))


def outputs_of(feed=None, figures=None, plots=None) -> tuple:
    """One update of a run's outputs, in their order: the panel feed (feed_of), the figures and the four charts.
    What is not given stays as it is."""
    return (gr.skip() if feed is None else feed, gr.skip() if figures is None else figures,
            *(plots or (gr.skip(),) * CHARTS))


def feed_of(messages: dict, charts: bool = False, run: str | None = None) -> str | None:
    """The panel feed's value for one update: each live panel's message (engine -> PanelFeed.message, None where the
    panel does not change); None when nothing changes. `run` (the panels' run) with `charts` (the update redraws the
    charts): the page shows the charts as the run's, not faded, even when no panel changes (assets/live_panel.js)."""
    panels = {engine: json.loads(m) for engine, m in messages.items() if m is not None}
    if not panels and not (charts and run):
        return None
    return json.dumps({"panels": panels} | ({} if run is None else {"run": run}) | ({"charts": True} if charts else {}))


def notices(engines, message: str) -> str | None:
    """The feed's value that puts the same message in each engine's panel."""
    return feed_of(dict.fromkeys(engines, message))


def panel_status(result, pace: float | None = None) -> str:
    """How a panel's run stands: how it finished, or that it runs. `pace`: the seconds between updates where the page
    shows a timed run only that often."""
    if result.finish_reason:
        return f"{result.finish_reason} · {len(result.output_tokens)} tokens"
    return "running…" if pace is None else f"running… · shown every {pace:g} s, to stay out of its timed run"


def _panel_note(result, pace: float | None = None) -> str:
    """The line under a panel: its status, and why its run drafts nothing where it does not."""
    note = panel_status(result, pace)
    if speculation_idle(result):
        note += (f" · no drafts in its first {IDLE_CHECK_PASSES} target passes: speculation is off, or its drafter "
                 "finds nothing to propose here")
    return note


def _save_note(comp: Comparison) -> str:
    """Under the figures: why the run is not (completely) in the history, if it is not."""
    return f'<div class="panel-error save-error">{escape(comp.save_error)}</div>' if comp.save_error else ""


def panel_interval(comp: Comparison) -> float:
    """Seconds between two updates of the panels: PANEL_S_PER_ENGINE per panel, and where the updates land in timed
    runs at least PANEL_WHILE_TIMED_S (engines at once) or PANEL_IN_WHOLE_RUN_S (fair turns of a whole run)."""
    least = {"alternate": 0.0, "parallel": PANEL_WHILE_TIMED_S, "sequential": PANEL_IN_WHOLE_RUN_S}[comp.strategy]
    return max(PANEL_S_PER_ENGINE * len(comp.engines), least)


def hand_over(comp: Comparison, update):
    """Yields one update to Gradio, which postprocesses it (plotly's JSON, the diff to the last one) and sends it to
    the browser before it asks for the next one; then, SETTLE_S later, lets the next timed pass go (page_idle: the
    turn then also waits until the browser's processes are quiet, runner.Comparison._take_turns)."""
    try:
        yield update
        time.sleep(SETTLE_S)
    finally:
        comp.page_idle.set()


def stream(comp: Comparison, panel_run: str, mode: str, show_rejected: bool):
    """Starts the comparison and yields its updates, throttled (panel_interval, FIGURES_EVERY_S, CHART_EVERY_S),
    until it ends. In fair mode each next timed pass waits until the last update was handed over (hand_over)."""
    feeds = {e: PanelFeed(panel_run, show_rejected and e != "baseline") for e in comp.engines}
    every = panel_interval(comp)
    pace = every if comp.strategy == "sequential" else None  # said in the panels: a whole run is shown that seldom
    # no chart update as the run begins (there is nothing to chart yet, and the charts' drawing was the
    # browser's largest single cost): the page fades the last run's charts until the first, CHART_EVERY_S in
    last_panel = last_figures = 0.0
    last_chart = time.monotonic()
    comp.start()
    while True:
        done = comp.poll(timeout=every)
        now = time.monotonic()
        if not done and now - last_panel < every:
            continue
        figures_due = done or now - last_figures >= FIGURES_EVERY_S
        chart_due = done or now - last_chart >= CHART_EVERY_S
        with comp.ui_lock:  # in fair mode: never while an engine's pass is being timed
            comp.page_idle.clear()  # and the next pass waits until this update was handed over (below)
            results = comp.results
            panels = {e: feeds[e].message(results[e].tokens, _panel_note(results[e], pace), results[e].error,
                                          final=done) for e in comp.engines}
            if figures_due:
                s = results["speculative"]
                figures = figures_html(results["baseline"], s, comp.comparison(results), mode,
                                       rolling_acceptance(s), comp.checks().get("speculative"))
                if len(comp.engines) > len(ENGINES):  # an N-way run: every engine's figures, in one table
                    figures += engines_html(results, comp.labels, comp.comparisons(results), mode)
                figures += _save_note(comp)
            plots = figures_for(results, comp.labels) if chart_due else None
        last_panel = now
        last_figures, last_chart = (now if figures_due else last_figures), (now if chart_due else last_chart)
        feed = feed_of(panels, charts=plots is not None, run=panel_run)
        yield from hand_over(comp, outputs_of(feed, figures if figures_due else None, plots))
        if done:
            break
