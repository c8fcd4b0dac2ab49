"""The columns the History table and the CSV files show, each named once: the History table's columns (the runs
table's column, its header, how a cell shows it), the figures of each engine (engine.run_metrics.RunMetrics fields)
that both CSVs carry, and the run's own columns in the runs CSV. docs/history.md#the-csv-files says what each
figure means."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

from engine.comparison import ComparisonFigures
from engine.run_metrics import RunMetrics


def figure(value) -> float | None:
    """A stored figure, rounded; a tampered file's text or NaN shows as an empty cell."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return round(value, 2)


def _text(value) -> str:
    return value or ""


@dataclass(frozen=True)
class ListColumn:
    key: str  # the runs table's column
    header: str  # the History table's
    cell: Callable[[object], object] = _text


# The History table's columns: never outputs, metrics or events, so that a page of a long history reads a few KB
LIST = (
    ListColumn("id", "id"),
    ListColumn("created_at", "created", lambda v: (v or "")[:19].replace("T", " ")),
    ListColumn("status", "status"),
    ListColumn("category", "category"),
    ListColumn("mode", "mode"),
    ListColumn("method", "method"),
    ListColumn("speedup", "speedup", figure),
    ListColumn("acceptance_rate", "acceptance", figure),
    ListColumn("identical", "identical", lambda v: {1: "yes", 0: "no"}.get(v, "")),
    ListColumn("sampling_check", "sampling check"),
    ListColumn("noisy", "machine", lambda v: {1: "noisy", 0: "quiet"}.get(v, "")),
    ListColumn("prompt", "prompt"),  # its first 80 characters (History.page)
)

# Per engine, in both CSVs (the runs CSV prefixes them with the engine's name, e.g. baseline_ttft_ms)
ENGINE_FIGURES = ("tokens_per_s", "acceptance_rate", "mean_accepted_length", "output_tokens", "ttft_ms", "tpot_ms",
                  "target_passes", "drafted", "accepted", "provisional_accuracy", "ignored_drafts",
                  "acceptance_histogram", "steps_accepting_nothing", "drafting_ms", "verifying_ms", "other_ms")

# The figures of an engine's comparison with the baseline (engine.comparison.ComparisonFigures), in both CSVs
COMPARISON_FIGURES = ("speedup", "identical", "first_divergence", "divergence_margin")
# ... and more of them, in the runs CSV only
COMPARISON_DETAIL = ("decode_speedup", "alpha", "theoretical_bound", "machine_bound", "efficiency")

# The runs CSV: the run's own columns (the runs table's), then its settings, its comparison's figures and each
# engine's columns
RUN_CSV = ("id", "created_at", "finished_at", "status", "error", "category", "backend", "target_model", "draft_model",
           "method", "mode", "suite_id", "prompt", "speedup", "acceptance_rate", "mean_accepted_length",
           "baseline_tps", "speculative_tps", "identical", "first_divergence", "noisy", "sampling_check",
           "nll_baseline", "nll_speculative", "repeat")
# The engines CSV, one row per run and engine; each engine's columns in the runs CSV are these after run_id and engine
ENGINE_CSV = ("run_id", "engine", "label", "method", *COMPARISON_FIGURES, *ENGINE_FIGURES, "server_counters_mismatch",
              "error", "output")


def engine_figures(metrics: RunMetrics) -> dict:
    return {key: getattr(metrics, key) for key in ENGINE_FIGURES}


def comparison_figures(comparison: ComparisonFigures, keys: tuple[str, ...]) -> dict:
    """`keys` of COMPARISON_FIGURES or COMPARISON_DETAIL, by name."""
    return {key: getattr(comparison, key) for key in keys}
