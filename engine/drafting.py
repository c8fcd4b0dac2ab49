"""How a speculative engine drafts: the one type that crosses the Backend seam for it.

A Request carries a Drafting (the local engines apply it per run), `Backend.drafting()` reports a server's, and
`Backend.reconfigure()` restarts a server's speculative engine with one. Which of these a backend takes is said by
its Capabilities (per_request_drafting, can_reconfigure, methods, k_range), never by its name.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.limits import DYNAMIC_K_MAX, MAX_K, SettingsError, check_range
from engine.methods import PROPOSERS

# hybrid drafting looks the text up when at least this many tokens repeat verbatim, as prompt-lookup decoding's
# default n-gram size: one or two tokens ("the", ", ") recur everywhere and would overrule a better draft model
HYBRID_MIN_MATCH = 3
# FR-Spec's smallest pruned draft vocabulary: below it even common text falls outside the kept tokens
MIN_DRAFT_VOCAB = 1024

# The settings the page's form sets; a backend without per-request drafting ignores them (and says so).
DRAFTING_SETTINGS = ("method", "k", "dynamic_k", "fallback", "draft_confidence", "draft_vocab")
# A server's restart settings (reconfigure()); no backend applies them from a request.
SERVER_SETTINGS = ("draft", "options")


@dataclass(frozen=True)
class Drafting:
    """`method` and `k` mean the same everywhere: how drafts are made, and how many per step. In a request, `method`
    is a key of engine.methods.PROPOSERS; for reconfigure() it is one of the backend's Capabilities.methods, in the
    server's own names, and `draft` and `options` are the server's draft model and further settings. The remaining
    fields are our policy's (engine.exact.policy), which a server's own policy does not read."""

    method: str = "draft"
    k: int | None = 4  # drafts per step (dynamic K: the first step's); None: a server's own default
    draft: str | None = None  # a server's draft model (None: the one it was started with)
    options: tuple[tuple[str, object], ...] = ()  # a server's own settings, (name, value): vLLM's prompt_lookup_min
    dynamic_k: bool = False
    k_max: int = DYNAMIC_K_MAX  # dynamic K's ceiling
    fallback: bool = False
    draft_confidence: float = 0.0  # stop drafting after a token the draft itself gives less than this (0 = off)
    per_token: bool = True  # with dynamic K, a draft model stops by policy.DraftStop (False: K from the i.i.d. model)
    verify_curve: bool = True  # DraftStop reads each length's measured verify cost (False: linear in length)
    token_tree: bool = True  # greedy, local: a short pass's free rows verify the draft's alternatives (exact.tree)
    ngram_min: int = 1
    ngram_max: int = 4
    hybrid_min_match: int = HYBRID_MIN_MATCH  # hybrid: the shortest n-gram match that is trusted over the draft model
    draft_vocab: int = 0  # FR-Spec: the draft model drafts among its N most frequent tokens only (0 = all of them)

    def server_settings_set(self) -> tuple[str, ...]:
        """Which of SERVER_SETTINGS this drafting sets: in a request, ignored by every backend (and said so)."""
        return tuple(name for name in SERVER_SETTINGS if getattr(self, name))

    def validate(self) -> None:
        """SettingsError unless a run can draft this way (a request's drafting; a backend checks what it needs more:
        its K range, its draft model's size)."""
        if self.method not in PROPOSERS:
            raise SettingsError(f"method must be one of {', '.join(PROPOSERS)}, got {self.method!r}")
        if self.k is None:
            raise SettingsError("a run needs K, the drafts per step")
        check_range("K", self.k, 1, MAX_K)
        if self.hybrid_min_match < 1:
            raise SettingsError(f"the hybrid's n-gram match needs at least 1 token, got {self.hybrid_min_match}")
        if not 0.0 <= self.draft_confidence < 1.0:
            raise SettingsError(f"draft confidence must be in [0, 1), got {self.draft_confidence}")
        if self.draft_vocab != 0 and self.draft_vocab < MIN_DRAFT_VOCAB:  # the backend checks the draft's size
            raise SettingsError(f"the draft vocabulary (FR-Spec) must be 0 (the full vocabulary) or at least "
                                f"{MIN_DRAFT_VOCAB} tokens, got {self.draft_vocab}")
        check_range("dynamic K's ceiling", self.k_max, 1, MAX_K)
