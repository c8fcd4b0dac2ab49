"""What one run asks for, independent of the backend that serves it: the same Request drives the baseline and the
speculative engine, on the local backend and on vLLM servers."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.drafting import Drafting
from engine.limits import DYNAMIC_K_MAX, MAX_NEW_TOKENS, SettingsError, check_range
from engine.methods import needs_draft
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Request:
    """Everything a run needs besides the models. The same request drives both engines; the baseline reads no
    `drafting`."""

    prompt: str
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    drafting: Drafting = field(default_factory=Drafting)
    stop_strings: tuple[str, ...] = ()
    chat: bool = True
    earlier_turns: tuple[tuple[str, str], ...] = ()  # (role, content) of a multi-turn chat before this prompt

    def validate(self) -> None:
        if not self.prompt.strip():
            raise SettingsError("the prompt is empty: type a prompt or pick an example")
        check_range("max new tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)
        self.drafting.validate()
        self.sampling.validate()

    def with_drafting(self, **changes) -> Request:
        """This request with some drafting settings changed (a variant of an N-way run, a sweep's value)."""
        return replace(self, drafting=replace(self.drafting, **changes))


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
        drafting=Drafting(
            method=method, k=int(k), dynamic_k=bool(dynamic_k), k_max=max(DYNAMIC_K_MAX, int(k)),
            fallback=bool(fallback),
            # the draft model's own confidence and vocabulary: meaningless to other proposers, not saved with their runs
            draft_confidence=float(draft_confidence) if needs_draft(method) else 0.0,
            draft_vocab=int(draft_vocab or 0) if needs_draft(method) else 0),
        stop_strings=tuple(s for s in stop_strings if s),
    )
