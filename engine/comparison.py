"""A speculative run's figures against its baseline, as one type: what engine.metrics.compare computes, and what the
history stores (as JSON, in the comparison columns) and the figures, the CSVs, the workbench and the replay read.

None means not known (a cost not measured, a sampled run's exactness): shown as unknown, never guessed. The theory
behind the bounds is engine.metrics' docstring.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class ComparisonFigures:
    """One speculative engine's run against the baseline's (engine.metrics.compare computes it)."""

    speedup: float | None = None  # speculative tokens/s over the baseline's, the prefill included
    decode_speedup: float | None = None  # the same after step 0 (RunMetrics.decode_tokens_per_s)
    # the model's inputs, measured in the two runs; None where the speculative run has no timed decoding steps with
    # drafts, or the baseline no plain step (servers: their steps carry no timings)
    alpha: float | None = None  # per-token acceptance probability (engine.metrics.acceptance_alpha)
    draft_cost_ratio: float | None = None  # c: a draft token's cost in plain target steps
    verify_cost_ratio: float | None = None  # v: a verifying pass's mean cost in plain target steps
    expected_tokens_per_pass: float | None = None  # E at alpha, averaged over the steps at the K each drafted
    theoretical_bound: float | None = None  # E / (cK + 1): verifying costs one plain step
    machine_bound: float | None = None  # E / (cK + v): verifying costs what it cost on this machine
    efficiency: float | None = None  # decode_speedup / machine_bound
    # greedy runs only (None when sampled: the sampling check judges those)
    identical: bool | None = None  # the two outputs are the same, token for token
    first_divergence: int | None = None  # the first output token where they differ; None where identical
    # at the first divergence, each engine's pass there: {"baseline": {...}, "speculative": {...}}
    # (engine.metrics.near_tie); None where the outputs are identical, or an engine recorded no runner-up there
    near_tie: dict | None = None
    divergence_margin: float | None = None  # the plain pass's logit margin there (near_tie's baseline margin)

    def to_dict(self) -> dict:
        """The JSON form the history saves (each field under its name, None included)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict | None) -> ComparisonFigures:
        """The figures from their saved form, also as older versions saved them: a key a version did not write is
        unknown, and the keys saved beside the figures (the machine's load, the sampling check) are not figures."""
        if not isinstance(saved, dict):  # a hand-edited file may hold anything
            return cls()
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in saved.items() if key in known})
