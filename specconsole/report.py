"""Suite results as figures, CSV files, and one self-contained HTML report to share after a talk."""

from __future__ import annotations

from html import escape
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from specconsole.advisor import ENABLE_AT, Advice
from specconsole.charts import BLUE, GREY, LAYOUT, ORANGE, PURPLE
from specconsole.export import neutralise


def _label(row) -> str:
    # plotly reads tags (links, styles) in its text: a category from an uploaded file shows as text
    return escape(f"{row['category']} {row['sweep_value']}".strip())


def speedup_chart(agg: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    if not agg.empty:
        labels = [_label(r) for _, r in agg.iterrows()]
        fig.add_bar(x=labels, y=agg["speedup"], name="median over prompts, 95 % CI", marker_color=BLUE,
                    error_y=dict(type="data", symmetric=False, array=agg["speedup_high"] - agg["speedup"],
                                 arrayminus=agg["speedup"] - agg["speedup_low"]))
        fig.add_scatter(x=labels, y=agg["machine_bound"], name="bound on this machine", mode="markers",
                        marker=dict(symbol="diamond", size=11, color=ORANGE))
        fig.add_hline(y=1.0, line_dash="dot", line_color=GREY)
        fig.add_hline(y=ENABLE_AT, line_dash="dash", line_color=GREY, annotation_text=f"enable at {ENABLE_AT:.2f}x",
                      annotation_position="top left")
    fig.update_layout(title="Speedup per category (bars: 95 % bootstrap CI over prompts) vs bound",
                      yaxis_title="x baseline", **LAYOUT)
    return fig


def acceptance_chart(agg: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    for _, row in agg.iterrows():
        if row["per_position"]:
            fig.add_scatter(x=list(range(1, len(row["per_position"]) + 1)), y=row["per_position"], name=_label(row),
                            mode="lines+markers")
    fig.update_layout(title="Per-position acceptance", xaxis_title="position in the draft",
                      yaxis=dict(title="accepted fraction", range=[0, 1.05]), **LAYOUT)
    return fig


def latency_chart(agg: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    if not agg.empty:
        labels = [_label(r) for _, r in agg.iterrows()]
        fig.add_bar(x=labels, y=agg["tpot_ms_baseline"], name="TPOT baseline", marker_color=GREY)
        fig.add_bar(x=labels, y=agg["tpot_ms_speculative"], name="TPOT speculative", marker_color=PURPLE)
        fig.add_scatter(x=labels, y=100 * agg["prefill_share"], name="prefill share of time (%)", mode="markers",
                        yaxis="y2", marker=dict(symbol="square", size=10, color=ORANGE))
    fig.update_layout(title="Time per output token, and prefill's share", yaxis_title="ms",
                      yaxis2=dict(title="%", overlaying="y", side="right", range=[0, 100]), barmode="group", **LAYOUT)
    return fig


def ab_chart(ab: pd.DataFrame, name_a: str, name_b: str) -> go.Figure:
    """workbench.ab_compare rows: the ratio B/A of the speedups per category, with its 95 % interval."""
    fig = go.Figure()
    name_a, name_b = escape(name_a), escape(name_b)  # plotly reads tags in its text
    both = ab.dropna(subset=["ratio"]) if not ab.empty else ab
    if not both.empty:
        fig.add_bar(x=[_label(r) for _, r in both.iterrows()], y=both["ratio"], name=f"{name_b} / {name_a}",
                    marker_color=PURPLE, error_y=dict(type="data", symmetric=False,
                                                      array=both["ratio_high"] - both["ratio"],
                                                      arrayminus=both["ratio"] - both["ratio_low"]))
        fig.add_hline(y=1.0, line_dash="dot", line_color=GREY)
    fig.update_layout(title=f"A/B: speedup of {name_b} relative to {name_a} (bars: 95 % CI)",
                      yaxis_title="ratio B / A", **LAYOUT)
    return fig


def concurrency_chart(conc: pd.DataFrame | None) -> go.Figure:
    fig = go.Figure()
    if conc is not None and not conc.empty:
        fig.add_scatter(x=conc["concurrency"], y=conc["speedup"], mode="lines+markers", marker_color=PURPLE,
                        name="speedup")
        fig.add_hline(y=1.0, line_dash="dot", line_color=GREY)
    fig.update_layout(title="Speedup vs concurrent requests (vLLM)", xaxis=dict(title="parallel requests",
                      type="log"), yaxis_title="x baseline", **LAYOUT)
    return fig


def figures(agg: pd.DataFrame, conc: pd.DataFrame | None = None) -> list[go.Figure]:
    figs = [speedup_chart(agg), acceptance_chart(agg), latency_chart(agg)]
    if conc is not None and not conc.empty:
        figs.append(concurrency_chart(conc))
    return figs


def write_csvs(runs: pd.DataFrame, agg: pd.DataFrame, runs_path: Path) -> list[Path]:
    """One row per run at runs_path, one per category beside it (<stem>_categories.csv)."""
    runs_path.parent.mkdir(parents=True, exist_ok=True)
    categories_path = runs_path.with_name(runs_path.stem + "_categories.csv")
    runs.map(neutralise).to_csv(runs_path, index=False)
    agg.map(neutralise).to_csv(categories_path, index=False)
    return [runs_path, categories_path]


def write_html(agg: pd.DataFrame, advice: list[Advice], out: Path, suite_id: str, title_note: str = "",
               conc: pd.DataFrame | None = None) -> Path:
    parts = [f"<h1>SpecConsole suite {escape(suite_id)}</h1>", f"<p>{escape(title_note)}</p>", "<h2>Advice</h2>"]
    for a in advice:
        parts.append(f"<h3>{escape(f'{a.category}: {a.verdict}{a.details()}')}</h3><ul>"
                     + "".join(f"<li>{escape(r)}</li>" for r in a.reasons) + "</ul>")
    parts.append("<h2>Per category</h2><p>speedup: the median over prompts of each prompt's median over its "
                 "repeats; speedup_low, speedup_high: its 95 % percentile-bootstrap interval over prompts; noise_cv: "
                 "the baseline's tokens/s coefficient of variation between repeats of one prompt (median over "
                 "prompts).</p>")
    parts.append(agg.map(neutralise).to_html(index=False, float_format=lambda v: f"{v:.3g}"))
    for i, fig in enumerate(figures(agg, conc)):  # plotly.js is embedded once: the file works offline
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    out.write_text("<!doctype html><html><head><meta charset='utf-8'><title>SpecConsole report</title>"
                   "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse}"
                   "td,th{border:1px solid #ccc;padding:3px 6px}</style></head><body>" + "\n".join(parts)
                   + "</body></html>")
    return out
