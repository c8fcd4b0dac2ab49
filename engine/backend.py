"""The local backend: a target (and optionally a draft) in this process, and the request both engines serve."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from engine.drafters import DraftModelProposer, NgramProposer
from engine.events import Event
from engine.local import generate_baseline, generate_speculative, score_outputs
from engine.models import PRESETS, LoadedModel, ModelError, Preset, check_pair, encode_prompt, load, pick_device
from engine.policy import SpecPolicy
from engine.sampling import MAX_K, SamplingParams, SettingsError
from engine.stops import StopConditions
from engine.weights import Progress

log = logging.getLogger(__name__)

MAX_NEW_TOKENS = 4096


@dataclass(frozen=True)
class Request:
    """Everything a run needs besides the models. The same request drives both engines."""

    prompt: str
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    method: str = "draft"  # "draft" | "ngram"
    k: int = 4
    dynamic_k: bool = False
    k_max: int = 16
    fallback: bool = False
    draft_confidence: float = 0.0  # stop drafting after a token the draft itself gives less than this (0 = off)
    per_token: bool = True  # with dynamic K, a draft model stops by policy.DraftStop (False: K from the i.i.d. model)
    ngram_min: int = 1
    ngram_max: int = 4
    stop_strings: tuple[str, ...] = ()
    chat: bool = True
    earlier_turns: tuple[tuple[str, str], ...] = ()  # (role, content) of a multi-turn chat before this prompt

    def validate(self) -> None:
        if not self.prompt.strip():
            raise SettingsError("the prompt is empty: type a prompt or pick an example")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise SettingsError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS}, got {self.max_new_tokens}")
        if self.method not in ("draft", "ngram"):
            raise SettingsError(f"method must be 'draft' or 'ngram', got {self.method!r}")
        if not 1 <= self.k <= MAX_K:
            raise SettingsError(f"K must be between 1 and {MAX_K}, got {self.k}")
        if not 0.0 <= self.draft_confidence < 1.0:
            raise SettingsError(f"draft confidence must be in [0, 1), got {self.draft_confidence}")
        self.sampling.validate()
        self.policy().validate()

    def policy(self) -> SpecPolicy:
        k_max = max(self.k_max, self.k) if self.dynamic_k else self.k
        return SpecPolicy(k=self.k, dynamic=self.dynamic_k, k_max=k_max, fallback=self.fallback,
                          per_token=self.per_token and self.method == "draft")


class LocalBackend:
    name = "local"

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None):
        if draft is not None:
            check_pair(target, draft)
        self.target, self.draft = target, draft
        self.target_step_ms: float | None = None  # measured by baseline runs; lets the fallback judge from step 1

    @classmethod
    def from_preset(
        cls, preset: Preset | str, device: str | None = None, strict: bool = False, on_progress: Progress | None = None
    ) -> "LocalBackend":
        if isinstance(preset, str):
            if preset not in PRESETS:
                raise ModelError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
            preset = PRESETS[preset]
        dev = pick_device(device)
        target = load(preset.target, "target", dev, strict=strict, on_progress=on_progress)
        draft = load(preset.draft, "draft", dev, int8=preset.int8_draft, on_progress=on_progress) if preset.draft else None
        return cls(target, draft)

    fair_strategy = "alternate"  # in-process engines are fair when they take turns, one target pass each

    def describe(self) -> dict:
        return {"backend": "local", "target_model": self.target.name,
                "draft_model": self.draft.name if self.draft else None}

    def memory(self) -> dict:
        """Weights in memory vs what the device has, for the advisor's "is there room for a second model"."""
        import psutil
        import torch

        if self.target.device.type == "cuda":
            available = torch.cuda.get_device_properties(self.target.device).total_memory
        else:
            available = psutil.virtual_memory().total
        gb = 1 << 30
        draft = self.draft.nbytes if self.draft else 0
        return {"target_gb": self.target.nbytes / gb, "draft_gb": draft / gb,
                "needed_gb": (self.target.nbytes + draft) / gb, "available_gb": available / gb}

    def prompt_ids(self, req: Request) -> list[int]:
        req.validate()
        if req.method == "draft" and self.draft is None:
            raise SettingsError("this setup has no draft model: choose n-gram drafting or load a draft")
        ids = encode_prompt(self.target.tokenizer, req.prompt, req.chat, req.earlier_turns)
        room = self.target.max_context - req.max_new_tokens
        if len(ids) > room:
            raise SettingsError(
                f"the prompt is {len(ids)} tokens; with {req.max_new_tokens} new tokens that exceeds the model's "
                f"context of {self.target.max_context} tokens. Shorten the prompt or ask for fewer tokens."
            )
        return ids

    def stops(self, req: Request) -> StopConditions:
        return StopConditions(req.max_new_tokens, self.target.eos_ids, tuple(s for s in req.stop_strings if s))

    def baseline(self, req: Request, cancel: threading.Event | None = None, clock=time.perf_counter) -> Iterator[Event]:
        ids = self.prompt_ids(req)
        t = self.target
        for event in generate_baseline(t.model, t.tokenizer, ids, req.sampling, self.stops(req), cancel, clock):
            if getattr(event, "engine", None) == "baseline" and event.metrics.get("plain_step_ms"):
                self.target_step_ms = event.metrics["plain_step_ms"]
            yield event

    def score(self, req: Request, outputs: list[list[int]]) -> list[list[float]]:
        """Log-probability of each token of each output under the target (raw distribution, temperature 1), given the
        request's prompt: one prefill, then one forward pass per output over its tokens (for the sampling check)."""
        prompt = self.prompt_ids(req)
        return score_outputs(self.target.model, prompt, outputs)

    def speculative(self, req: Request, cancel: threading.Event | None = None, clock=time.perf_counter) -> Iterator[Event]:
        ids = self.prompt_ids(req)
        t = self.target
        if req.method == "draft":
            proposer = DraftModelProposer(self.draft.model, t.vocab_size, req.sampling, None, req.draft_confidence)
        else:
            proposer = NgramProposer(req.ngram_min, req.ngram_max)
        policy = req.policy()
        policy.target_step_ms = self.target_step_ms
        yield from generate_speculative(
            t.model, t.tokenizer, proposer, ids, req.sampling, self.stops(req), policy, cancel, clock
        )
