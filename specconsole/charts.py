"""Plotly figures built from run events: acceptance per step, per-position acceptance, tokens over time, where the
time went per target pass.

An N-way comparison passes its extra speculative engines as `others` (label -> RunResult): one more trace each
(in the time chart: one more row)."""

from __future__ import annotations

from html import escape

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.events import RunResult

# Okabe-Ito colours: distinguishable with the common forms of colour blindness
BLUE, ORANGE, PURPLE, GREY = "#0072B2", "#E69F00", "#CC79A7", "#777777"
SPLIT = (("drafting", ORANGE), ("target pass", BLUE), ("other", "#999999"))  # where a pass's time went, bottom up
EXTRA_COLOURS = ("#009E73", "#D55E00", "#56B4E9")  # the extra speculative engines, in order
LAYOUT = dict(height=300, margin=dict(l=50, r=20, t=60, b=40), template="plotly_white",
              legend=dict(orientation="h", y=1.0, yanchor="bottom", x=1.0, xanchor="right"))


def acceptance_per_step(spec: RunResult | None, others: dict[str, RunResult] | None = None) -> go.Figure:
    fig = go.Figure()
    steps = [s for s in (spec.steps if spec else []) if s.drafted > 0]
    if steps:
        fig.add_bar(x=[s.time_s for s in steps], y=[s.drafted for s in steps], name="drafted (K)",
                    marker_color="rgba(0,114,178,0.25)")
        fig.add_bar(x=[s.time_s for s in steps], y=[s.accepted for s in steps], name="accepted", marker_color=BLUE)
        fig.update_layout(barmode="overlay")
    for (label, run), colour in zip((others or {}).items(), EXTRA_COLOURS):  # accepted per step, as markers
        steps = [s for s in run.steps if s.drafted > 0]
        fig.add_scatter(x=[s.time_s for s in steps], y=[s.accepted for s in steps], name=f"accepted ({escape(label)})",
                        mode="markers", marker=dict(color=colour, size=6))
    fig.update_layout(title="Drafted and accepted per step", xaxis_title="seconds", yaxis_title="tokens", **LAYOUT)
    return fig


def per_position(spec: RunResult | None, others: dict[str, RunResult] | None = None) -> go.Figure:
    fig = go.Figure()
    runs = [("speculative" if others else "acceptance", spec, ORANGE),
            *[(escape(label), run, colour) for (label, run), colour in zip((others or {}).items(), EXTRA_COLOURS)]]
    for name, run, colour in runs:  # one bar group per engine, side by side
        rates = run.metrics.per_position_acceptance if run else []
        if rates:
            fig.add_bar(x=list(range(1, len(rates) + 1)), y=rates, marker_color=colour, name=name)
    fig.update_layout(title="Acceptance by draft position", xaxis_title="position in the draft",
                      yaxis=dict(title="accepted fraction", range=[0, 1.05]), **LAYOUT)
    return fig


def tokens_over_time(baseline: RunResult | None, spec: RunResult | None,
                     others: dict[str, RunResult] | None = None) -> go.Figure:
    fig = go.Figure()
    lines = [(baseline, "baseline", GREY, "dot"), (spec, "speculative", PURPLE, "solid"),
             *[(run, escape(label), colour, "solid") for (label, run), colour in zip((others or {}).items(),
                                                                                    EXTRA_COLOURS)]]
    for run, name, colour, dash in lines:
        if run:
            out = run.output_tokens
            fig.add_scatter(x=[t.time_s for t in out], y=list(range(1, len(out) + 1)), name=name, mode="lines",
                            line=dict(color=colour, dash=dash, shape="hv"))
    fig.update_layout(title="Tokens over time", xaxis_title="seconds", yaxis_title="output tokens", **LAYOUT)
    return fig


# Plotly draws every bar on every update (the page's largest cost, docs/page-cost.md): a long run's passes are
# averaged in groups of consecutive passes, at most this many bars per engine.
MAX_BARS = 200
TIME_TITLE = "Where the time went, per target pass"


def pass_times(run: RunResult) -> list[tuple[float, float, float, float, float]] | None:
    """Each target pass as (start s, end s, drafting ms, target pass ms, other ms): it starts where the previous step
    ended (the run's start for the first), and `other` is the rest of that span, clamped at 0 (the pass timers and the
    run's clock are read apart). None where no step carries a timing (servers): the split is unknown there."""
    if run.steps and not any(s.draft_ms or s.verify_ms for s in run.steps):
        return None
    passes, start = [], 0.0
    for s in run.steps:
        other = max(0.0, 1000 * (s.time_s - start) - s.draft_ms - s.verify_ms)
        passes.append((start, s.time_s, s.draft_ms, s.verify_ms, other))
        start = s.time_s
    return passes


def grouped(passes: list, most: int = MAX_BARS) -> tuple[int, list]:
    """(n, bars): at most `most` bars, each the mean of n consecutive passes and spanning their time."""
    n = max(1, -(-len(passes) // most))
    if n == 1:
        return 1, passes
    bars = []
    for i in range(0, len(passes), n):
        group = passes[i:i + n]
        bars.append((group[0][0], group[-1][1], *(sum(p[k] for p in group) / len(group) for k in (2, 3, 4))))
    return n, bars


def _row_title(name: str, run: RunResult, passes: list | None, n: int) -> str:
    title = f"{name}: {len(run.steps)} target pass{'' if len(run.steps) == 1 else 'es'}"
    if passes is None:
        return title + ", split unknown (the engine does not time drafting and verifying apart)"
    if passes:
        title += f", the first (reading the prompt) {sum(passes[0][2:]):.0f} ms"
    return title + (f", each bar the mean of {n}" if n > 1 else "")


def time_per_pass(baseline: RunResult | None, spec: RunResult | None,
                  others: dict[str, RunResult] | None = None) -> go.Figure:
    """A stacked bar per target pass (drafting, the pass, other), one row per engine on one clock.

    x is the time in the run, not the pass index: a bar spans its pass, so an engine's bars tile its run and a reader
    sees the speculative engine's fewer, taller passes end before (or after) the baseline's many plain ones."""
    rows = [(name, run) for name, run in (("baseline", baseline), ("speculative", spec),
                                          *((escape(label), run) for label, run in (others or {}).items())) if run]
    if not rows:
        fig = go.Figure()
        fig.update_layout(title=TIME_TITLE, **LAYOUT)
        return fig
    known = [pass_times(run) for _, run in rows]
    groups = [grouped(passes or []) for passes in known]
    fig = make_subplots(rows=len(rows), cols=1, shared_xaxes=True, shared_yaxes="all", vertical_spacing=0.12,
                        subplot_titles=[_row_title(name, run, passes, n)
                                        for (name, run), passes, (n, _) in zip(rows, known, groups)])
    for row, (_, bars) in enumerate(groups, 1):
        for i, (part, colour) in enumerate(SPLIT):
            ms = [round(b[2 + i], 3) for b in bars]
            if any(ms):  # no trace of zeros (the baseline's drafting): every trace is drawn on every update
                fig.add_bar(x=[round((b[0] + b[1]) / 2, 5) for b in bars], width=[round(b[1] - b[0], 5) for b in bars],
                            y=ms, name=part, legendgroup=part, legendrank=i,
                            showlegend=not any(t.name == part for t in fig.data),
                            marker=dict(color=colour, line_width=0), hovertemplate="%{y:.1f} ms", row=row, col=1)
    fig.update_annotations(font_size=12, x=0, xanchor="left")  # the row titles, clear of the legend on the right
    fig.update_yaxes(title_text="ms per pass", rangemode="tozero")
    # an engine's first bar holds the pass that read the prompt, often many decoding passes long: the scale is the
    # other bars', so that the decoding passes show (the first may go off the top; its row title gives it)
    tops = [sum(b[2:]) for _, bars in groups for b in bars[1:]]
    if tops:
        fig.update_yaxes(range=[0, 1.05 * max(tops)])
    fig.update_xaxes(title_text="seconds", row=len(rows), col=1)
    fig.update_layout(title=TIME_TITLE, barmode="stack", bargap=0, **(LAYOUT | {"height": 140 + 110 * len(rows)}))
    return fig
