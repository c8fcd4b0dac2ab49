"""The one seam between the console and an inference backend.

A backend serves a Request twice: `baseline` (the target alone, one token per forward pass) and `speculative` (a
draft proposes, the target verifies). Both stream the events of engine.events and end with a RunResult. Everything
the console, the workbench, the model host and `launch.py` need from a backend is in `Backend` below; what differs
between backends is said in `Capabilities`, never probed with getattr/hasattr.

Implementations: engine.exact.backend.LocalBackend (our exact engines, in the process that builds it), served to the
console by engine.process.client.EngineProcess (the same backend in an engine process of its own);
engine.vllm.backend.VLLMBackend (real vLLM servers over HTTP; engine.vllm.client streams their answers) and
engine.llamacpp.backend.LlamaCppBackend (llama-server engines).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, runtime_checkable

from engine.drafting import Drafting
from engine.events import Event
from engine.limits import MAX_K, check_range
from engine.request import Request

Clock = Callable[[], float]

# The engines of a comparison: the baseline, the main speculative engine, and up to MAX_EXTRA more speculative ones
# (an N-way run; the page has panels for four speculative engines in all), named by extra_engine().
ENGINES = ("baseline", "speculative")
MAX_EXTRA = 3


def extra_engine(i: int) -> str:
    """The name of the i-th extra speculative engine (0-based): speculative-2, speculative-3, ..."""
    return f"speculative-{i + 2}"


# The drafts per step (K) any backend may be asked for: engine.limits' range, what the page offers before a backend is
# loaded; each backend's Capabilities.k_range lies within it.
K_RANGE = (1, MAX_K)


def cores_left_over(engine_cores: int) -> bool:
    """Whether engines pinned to `engine_cores` CPU cores in all leave at least one core of this machine free. Only
    then can fair mode run them at once ("parallel"): the console, its page and the browser need a core too, and
    without a free one their work lands on one engine's core and slows that engine alone (docs/page-cost.md: vLLM
    servers on one core each of a 2-core machine gave the page's baseline 0.78x the API's tok/s)."""
    return engine_cores < (os.cpu_count() or 1)


@dataclass(frozen=True)
class Capabilities:
    knows_rejected: bool  # the text of rejected drafts is known (our engine); a server only reports counts
    per_request_drafting: bool  # method, K, dynamic K, fallback, draft confidence and vocabulary apply per request
    can_reconfigure: bool  # the speculative side can be restarted with another drafting config (reconfigure())
    concurrent_requests: bool  # serves parallel requests: the workbench's concurrency sweep (throughput())
    # how fair mode is fair: "alternate" (one target pass each, in turns), "sequential" (one whole run, then the
    # other) or "parallel" (both at once, because each engine owns its cores or GPU share)
    fair_strategy: str = "alternate"
    # the extra speculative engines of an N-way run are the backend's own (vLLM: one server per drafting config,
    # listed by variants()), not drafting settings the console chooses per request
    fixed_variants: bool = False
    # the drafting methods reconfigure() restarts the speculative side with, in the backend's own names (empty where
    # the request's method applies: per_request_drafting), and those a method sweep runs unless told otherwise
    methods: tuple[str, ...] = ()
    sweep_methods: tuple[str, ...] = ()
    # the drafts per step (K) the backend drafts, lowest and highest: the request's K where per_request_drafting,
    # else the K reconfigure() restarts the speculative side with; the page's K sliders and the K sweep offer these
    k_range: tuple[int, int] = K_RANGE

    def check_k(self, k: int | None) -> None:
        """SettingsError unless the backend drafts `k` tokens per step (None: a server's own default K)."""
        if k is not None:
            low, high = self.k_range
            check_range("K", k, low, high, f"this backend drafts {low} to {high} tokens per step")


@runtime_checkable
class Backend(Protocol):
    name: str  # "local" | "vllm" | "llamacpp": for logs and saved runs; the console never branches on it
    capabilities: Capabilities

    def validate(self, req: Request) -> None:
        """Raise SettingsError (a message for the user) if this backend cannot serve `req`; nothing runs."""

    def ignored_settings(self, req: Request) -> tuple[str, ...]:
        """The names of `req`'s settings that this backend does not apply (say so in the page; never silently)."""

    def baseline(self, req: Request, cancel: threading.Event | None = None, clock: Clock = time.perf_counter
                 ) -> Iterator[Event]:
        """Target only. TokenEvents as they are committed, then one RunResult (also after cancel or an error)."""

    def speculative(self, req: Request, cancel: threading.Event | None = None, clock: Clock = time.perf_counter,
                    engine: str = "speculative") -> Iterator[Event]:
        """Draft and verify. Token, step and policy events (a backend that learns the kinds only at the end streams
        pending or provisional tokens and then one Reclassified), then one RunResult. `engine` picks which of the
        backend's own speculative engines serves it (a key of variants(), or the main "speculative")."""

    def variants(self) -> dict[str, dict]:
        """The extra speculative engines this backend serves itself, engine name -> {"label", "method"}
        ("speculative-2" -> {"label": "vLLM ngram K=2", "method": "ngram"}); empty where the extras are drafting
        settings of the request (capabilities.fixed_variants says which)."""

    def score(self, req: Request, outputs: list[list[int]]) -> list[list[float]]:
        """Log-probability of each output token under the target (temperature 1), for the sampling check."""

    def describe(self) -> dict:
        """backend, target_model, draft_model and method, saved with every run; a backend that serves its own
        speculative engines (Capabilities.fixed_variants) adds label: what the page calls the main one."""

    def memory(self) -> dict | None:
        """target_gb, draft_gb, needed_gb, available_gb where the backend knows them (else None)."""

    def drafting(self) -> Drafting | None:
        """The speculative engine's own drafting (a sweep restores it after restarting the engine per value); None
        where the request's drafting settings apply, or a server's settings are not known (attached)."""

    def reconfigure(self, drafting: Drafting) -> None:
        """Restart the speculative side with other drafting (only with capabilities.can_reconfigure); if that
        fails, the old drafting runs again and the error says why."""

    def calibration(self) -> dict:
        """The cost model our speculative policy drafts with (engine.exact.calibration: costs and when they were
        measured); {} where a server's own policy drafts (vLLM, llama.cpp)."""

    def recalibrate(self) -> dict:
        """Measure the cost model again, store it and return it (SettingsError where there is none)."""

    def throughput(self, engine: str, prompts: list[str], max_new_tokens: int,
                   cancel: threading.Event | None = None) -> tuple[int, float]:
        """Send all prompts at once (greedy); return (completion tokens, seconds). Only with concurrent_requests.
        Once `cancel` is set it stops waiting, drops the requests still open, and returns what had finished."""

    def close(self) -> None:
        """Release what the backend started (servers); safe to call twice."""
