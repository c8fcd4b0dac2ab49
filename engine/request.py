"""What one run asks for, independent of the backend that serves it: the same Request drives the baseline and the
speculative engine, on the local backend and on vLLM servers."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.limits import DYNAMIC_K_MAX, MAX_K, MAX_NEW_TOKENS, SettingsError, check_range
from engine.methods import PROPOSERS, needs_draft
from engine.sampling_params import SamplingParams

# hybrid drafting looks the text up when at least this many tokens repeat verbatim, as prompt-lookup decoding's
# default n-gram size: one or two tokens ("the", ", ") recur everywhere and would overrule a better draft model
HYBRID_MIN_MATCH = 3
# FR-Spec's smallest pruned draft vocabulary: below it even common text falls outside the kept tokens
MIN_DRAFT_VOCAB = 1024


@dataclass(frozen=True)
class Request:
    """Everything a run needs besides the models. The same request drives both engines."""

    prompt: str
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    method: str = "draft"  # a key of engine.methods.PROPOSERS: "draft", "ngram", "hybrid", ...
    k: int = 4
    dynamic_k: bool = False
    k_max: int = DYNAMIC_K_MAX  # dynamic K's ceiling
    fallback: bool = False
    draft_confidence: float = 0.0  # stop drafting after a token the draft itself gives less than this (0 = off)
    per_token: bool = True  # with dynamic K, a draft model stops by policy.DraftStop (False: K from the i.i.d. model)
    verify_curve: bool = True  # DraftStop reads each length's measured verify cost (False: linear in length)
    token_tree: bool = True  # greedy, local: a short pass's free rows verify the draft's alternatives (engine.exact.tree)
    ngram_min: int = 1
    ngram_max: int = 4
    hybrid_min_match: int = HYBRID_MIN_MATCH  # hybrid: the shortest n-gram match that is trusted over the draft model
    draft_vocab: int = 0  # FR-Spec: the draft model drafts among its N most frequent tokens only (0 = all of them)
    stop_strings: tuple[str, ...] = ()
    chat: bool = True
    earlier_turns: tuple[tuple[str, str], ...] = ()  # (role, content) of a multi-turn chat before this prompt

    def validate(self) -> None:
        if not self.prompt.strip():
            raise SettingsError("the prompt is empty: type a prompt or pick an example")
        check_range("max new tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)
        if self.method not in PROPOSERS:
            raise SettingsError(f"method must be one of {', '.join(PROPOSERS)}, got {self.method!r}")
        check_range("K", self.k, 1, MAX_K)
        if self.hybrid_min_match < 1:
            raise SettingsError(f"the hybrid's n-gram match needs at least 1 token, got {self.hybrid_min_match}")
        if not 0.0 <= self.draft_confidence < 1.0:
            raise SettingsError(f"draft confidence must be in [0, 1), got {self.draft_confidence}")
        if self.draft_vocab != 0 and self.draft_vocab < MIN_DRAFT_VOCAB:  # the backend checks the draft's size
            raise SettingsError(f"the draft vocabulary (FR-Spec) must be 0 (the full vocabulary) or at least "
                                f"{MIN_DRAFT_VOCAB} tokens, got {self.draft_vocab}")
        check_range("dynamic K's ceiling", self.k_max, 1, MAX_K)
        self.sampling.validate()


# --- one request builder --------------------------------------------------------------------------------------------
# The defaults of a run, used by the page's controls, `launch.py demo`, `launch.py suite` and the Workbench alike.
DEFAULT_MAX_NEW_TOKENS = 128
SUITE_MAX_NEW_TOKENS = 64  # a suite runs many prompts, each twice: shorter answers keep it to minutes
DEFAULT_K = 4
DEFAULT_DYNAMIC_K = True
DEFAULT_DRAFT_CONFIDENCE = 0.4
DEFAULT_FALLBACK = False  # measured side by side on 24 unseen prompts it paid nowhere (docs/llamacpp.md)
DEFAULT_TEMPERATURE = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_SEED = 0  # sampled runs repeat exactly unless the user picks another seed


def build_request(prompt: str = "", *, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, temperature=DEFAULT_TEMPERATURE,
                  top_p=DEFAULT_TOP_P, top_k: int = 0, seed=DEFAULT_SEED, method: str = "draft", k=DEFAULT_K,
                  dynamic_k=DEFAULT_DYNAMIC_K, draft_confidence=DEFAULT_DRAFT_CONFIDENCE, fallback=DEFAULT_FALLBACK,
                  stop_strings=(), draft_vocab=0) -> Request:
    """The Request of the page, the CLI and the suites. Takes the loose values a form or argparse gives (floats for
    ints, "" or None for no seed). A suite's base request has an empty prompt: each suite entry brings its own."""
    return Request(
        prompt=prompt or "", max_new_tokens=int(max_new_tokens),
        sampling=SamplingParams(float(temperature), int(top_k), float(top_p),
                                None if seed in (None, "") else int(seed)),
        method=method, k=int(k), dynamic_k=bool(dynamic_k), k_max=max(DYNAMIC_K_MAX, int(k)),
        # the draft model's own confidence and vocabulary: meaningless to other proposers, not saved with their runs
        draft_confidence=float(draft_confidence) if needs_draft(method) else 0.0,
        draft_vocab=int(draft_vocab or 0) if needs_draft(method) else 0,
        fallback=bool(fallback), stop_strings=tuple(s for s in stop_strings if s),
    )
