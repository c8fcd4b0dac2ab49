"""Plotly figures built from run events: acceptance per step, per-position acceptance, tokens over time.

An N-way comparison passes its extra speculative engines as `others` (label -> RunResult): one more trace each."""

from __future__ import annotations

from html import escape

import plotly.graph_objects as go

from engine.events import RunResult

# Okabe-Ito colours: distinguishable with the common forms of colour blindness
BLUE, ORANGE, PURPLE, GREY = "#0072B2", "#E69F00", "#CC79A7", "#777777"
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
