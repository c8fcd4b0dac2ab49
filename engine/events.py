"""The one event vocabulary that flows from the engines to the pixels and to the database.

Token kinds: accepted, rejected, recovered and bonus tokens, and which of them are output tokens, are defined once, in
engine.exact.sampling (where verification decides them; the terms follow Leviathan et al. and vLLM's rejection sampler).
Two kinds more:

    baseline   a token from plain decoding: one target forward pass, one token, no draft involved (the
               baseline engine, the prefill's token when step 0 had no drafts, and steps where speculation is
               switched off). An output token too.
    pending    a token streamed by a server that tells the kinds only when the request ends (vLLM): a
               Reclassified event then gives its kind, or it stays pending if the server never says.

A vLLM token may also stream with a *provisional* kind (TokenEvent.provisional): a guess from how the server split
its stream into chunks, shown as such until the Reclassified event confirms or corrects it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

from engine.run_metrics import RunMetrics


class TokenKind(str, Enum):
    BASELINE = "baseline"
    ACCEPTED = "accepted"
    RECOVERED = "recovered"
    BONUS = "bonus"
    REJECTED = "rejected"
    PENDING = "pending"


@dataclass
class TokenEvent:
    kind: TokenKind
    token_id: int
    text: str  # the token's piece of the output text ("" while a multi-byte character is incomplete)
    step: int  # speculation step (one target forward pass); step 0 reads the prompt (and any drafts after it)
    position: int  # position inside the step: 0..K
    time_s: float  # seconds since the run started
    index: int | None = None  # index in the output; None for rejected tokens
    p: float | None = None  # target probability of this token, where known
    q: float | None = None  # draft probability of this token, where known (1.0 for n-gram drafts)
    provisional: bool = False  # kind, step and position are a guess from chunk boundaries (vLLM), not yet told
    # greedy runs: the target's second-best token at this position and how far the chosen token's logit was above it
    # (engine.exact.sampling.runners_up; vLLM's top-2 logprobs): where two engines' greedy outputs part, a small one is
    # a near-tie. The runner-up is an id from our engine, a text from a server that names top tokens by text (vLLM)
    runner_up: int | None = None
    margin: float | None = None
    runner_up_text: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"] = self.kind.value
        return d


@dataclass
class StepRecord:
    """One target forward pass and the draft work that fed it."""

    step: int
    drafted: int  # K actually proposed (0 for a plain decoding step)
    accepted: int
    emitted: int  # tokens committed by this step (after stop conditions)
    draft_ms: float
    verify_ms: float  # the target forward pass (for a plain step: the decoding step itself)
    time_s: float  # when the step finished, seconds since the run started
    drafter: str = ""  # who drafted: "draft" | "ngram" (a hybrid run has both); "" for a plain step or not known
    ignored: int | None = None  # drafts the output never reached (engine.exact.sampling); None: not known (servers)


class PolicyAction(str, Enum):
    """A str Enum, like TokenKind: saved history and CSV exports keep the plain strings."""

    K_CHANGE = "k_change"
    FALLBACK = "fallback"
    RESUME = "resume"


@dataclass
class PolicyEvent:
    """A decision of the speculation policy: K changed, speculation switched off (fallback) or back on (resume)."""

    step: int
    action: PolicyAction
    k: int
    reason: str
    time_s: float


@dataclass
class Reclassified:
    """The kinds of tokens already streamed as pending or provisional, told when the request ended (a vLLM
    server's per-step counts). Yielded once, just before the RunResult; events already yielded are never changed
    afterwards, so a consumer applies this to its own copies (`apply`). The RunResult carries the same final
    tokens."""

    engine: str  # "speculative"
    tokens: list[tuple[int, TokenKind, int, int]]  # (index in the output, kind, step, position in the step)

    def apply(self, tokens: list[TokenEvent]) -> None:
        """Set kind, step and position of the tokens (matched by output index) in place; they are final now."""
        by_index = {t.index: t for t in tokens if t.index is not None}
        for index, kind, step, position in self.tokens:
            token = by_index.get(index)
            if token is not None:
                token.kind, token.step, token.position = kind, step, position
                token.provisional = False


@dataclass
class RunResult:
    engine: str  # "baseline" | "speculative"
    method: str  # "none" | "draft" | "ngram" | a vLLM method name
    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    tokens: list[TokenEvent] = field(default_factory=list)  # output and rejected tokens, in commit order
    steps: list[StepRecord] = field(default_factory=list)
    policy: list[PolicyEvent] = field(default_factory=list)
    finish_reason: str = ""  # "length" | "eos" | "stop" | "cancelled" | "error"
    error: str | None = None
    prefill_ms: float = 0.0
    total_s: float = 0.0
    metrics: RunMetrics = field(default_factory=RunMetrics)

    @property
    def output_tokens(self) -> list[TokenEvent]:
        return [t for t in self.tokens if t.kind != TokenKind.REJECTED]


# What an engine's stream yields: events as they happen, then the RunResult last.
Event = TokenEvent | StepRecord | PolicyEvent | Reclassified | RunResult
