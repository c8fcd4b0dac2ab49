"""The figures of one engine's run, as one type: what engine.metrics computes, what a server adds, and what the
history stores (as JSON) and the CSVs, the figures and the History table read.

None means not known (a server that does not say): shown as unknown, never guessed. The token terms (drafted,
accepted, rejected, ignored) are defined once, in engine.exact.sampling.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace


@dataclass
class ServerCounters:
    """A server's speculative-decoding counters from its Prometheus /metrics page, as they grew during one run (read
    before and after it): the server's own count beside ours (engine.serving.counters.server_counters)."""

    drafts: float  # verify passes that had drafts
    draft_tokens: float
    accepted_tokens: float
    per_position_acceptance: list[float] = field(default_factory=list)  # accepted / drafts, by draft position
    # where the server's counts disagree with the run's own (drafted, accepted): what differs; None where they agree
    mismatch: str | None = None
    # where they differ for a known reason (a stop inside the last step, a shared server, a stopped run): what and why
    expected_difference: str | None = None


@dataclass
class RunMetrics:
    """One engine's run in figures (engine.metrics.run_metrics computes them from the run's events)."""

    output_tokens: int = 0
    target_passes: int | None = None  # target forward passes, the prefill's included
    baseline_passes: int = 0  # what plain decoding needs for the same output: one pass per token
    passes_saved: int | None = None
    steps: int | None = None  # speculative steps: target passes that verified drafts
    drafted: int | None = None
    accepted: int | None = None
    acceptance_rate: float | None = None  # accepted / drafted
    per_position_acceptance: list[float] = field(default_factory=list)
    mean_accepted_length: float | None = None  # tokens per speculative step: 1 + accepted drafts
    mean_k: float | None = None  # drafts per speculative step
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None  # after step 0 (engine.metrics._decode_rate)
    prefill_ms: float = 0.0
    draft_ms_total: float = 0.0
    verify_ms_total: float = 0.0  # the speculative steps' target passes after the prefill
    draft_ms_per_token: float | None = None
    verify_ms_mean: float | None = None
    plain_step_ms: float | None = None  # a target pass without drafts (the baseline's decoding step)
    fallback_count: int = 0
    rejected_tokens: int = 0  # rejected drafts whose tokens the run knows
    rejected_drafts: int | None = None  # rejected drafts counted by a server that does not send their tokens
    tree_accepted: int = 0
    ignored_drafts: int | None = None
    # speculative steps by drafts accepted: [steps that accepted 0, 1, ...]; each 0 bought one token for a target
    # pass and a draft's cost
    acceptance_histogram: list[int] | None = field(default_factory=list)
    steps_accepting_nothing: float | None = None
    # where the run's time went (engine.metrics.time_split)
    drafting_ms: float | None = None
    verifying_ms: float | None = None
    other_ms: float | None = None
    # how exact the token marks are, where a server decides them (vLLM, llama.cpp); None: exact, our engine's own
    highlighting: str | None = None
    divergence_note: str | None = None  # why this backend's greedy output can part from its plain output
    provisional_accuracy: float | None = None  # vLLM: how often the kinds guessed while streaming were right
    unknown_token_ids: int | None = None  # llama.cpp: tokens streamed without an id
    engine_pid: int | None = None  # the engine process that ran the passes
    # the server's own per-request figures under its own names (vLLM's request metrics and completion_tokens;
    # llama.cpp's drafted and accepted from its timings)
    server: dict[str, float | None] = field(default_factory=dict)
    server_counters: ServerCounters | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict | None) -> RunMetrics:
        """Metrics from their JSON form, also as older versions saved them: figures under names this version no
        longer has go to `server` (they were a server's), the rest are ignored."""
        saved = dict(saved) if isinstance(saved, dict) else {}  # a hand-edited file may hold anything
        known = {f.name for f in fields(cls)}
        server = dict(saved.pop("server", None) or {})
        counters = saved.pop("server_counters", None)
        legacy = saved.pop("server_delta", None)  # the vLLM counters before they had a type
        per_position = saved.pop("server_per_position_acceptance", None)
        for key in [k for k in saved if k not in known]:
            value = saved.pop(key)
            for prefix in ("vllm_", "llamacpp_"):
                if key.startswith(prefix) and (value is None or isinstance(value, (int, float))):
                    server[key.removeprefix(prefix)] = value
        m = cls(**saved, server=server)
        try:
            if counters:
                m.server_counters = ServerCounters(**counters)
            elif legacy:
                m.server_counters = ServerCounters(legacy["num_drafts"], legacy["num_draft_tokens"],
                                                   legacy["num_accepted_tokens"], list(per_position or []))
        except (TypeError, KeyError):  # not the shape a version saved: unknown
            m.server_counters = None
        return m

    def steps_unknown(self, **known) -> RunMetrics:
        """These metrics with the figures that need to know which target pass made which token set to unknown (a
        server that cannot say), and `known` (figures it does say) set."""
        return replace(self, **STEPS_UNKNOWN | known)


STEPS_UNKNOWN = {"target_passes": None, "passes_saved": None, "steps": None, "drafted": None, "accepted": None,
                 "acceptance_rate": None, "mean_accepted_length": None, "mean_k": None, "per_position_acceptance": [],
                 "acceptance_histogram": None, "steps_accepting_nothing": None, "ignored_drafts": None}
