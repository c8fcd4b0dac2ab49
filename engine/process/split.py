"""One GPU split in two: the baseline and the speculative engine in two engine processes, each capped at its share
of the device's memory, as the managed vLLM servers are (`--vllm-memory`). `launch.py --local-memory 0.45,0.45`.

On a CUDA device each process caps its allocator (torch.cuda.set_per_process_memory_fraction) before it loads, so an
engine that outgrows its share fails with an out-of-memory error of its own instead of taking the other's memory;
the two engines then own their shares and fair mode runs them at once. On a CPU the share is checked once the models
are loaded (they must fit in it, or the process refuses to start and says so), and the engines, which share the
cores, take turns.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Callable, Iterator

from engine.drafting import Drafting
from engine.events import Event
from engine.limits import SettingsError
from engine.process.client import EngineProcess, Progress


def parse_shares(text: str) -> tuple[float, float]:
    """"0.45,0.45" -> (0.45, 0.45): the baseline's share, then the speculative engine's; SettingsError otherwise."""
    try:
        shares = tuple(float(x) for x in text.split(","))
    except ValueError:
        shares = ()
    if len(shares) != 2 or not all(0.0 < s <= 1.0 for s in shares) or sum(shares) > 1.0:
        raise SettingsError(f"--local-memory takes two shares of the device's memory, BASELINE,SPECULATIVE, each in "
                            f"(0, 1] and together at most 1; got {text!r}")
    return shares


def with_memory_share(share: float, factory: Callable, on_progress: Progress | None = None):
    """Build `factory`'s backend in this process, held to `share` of the device's memory (see the module's doc)."""
    import torch

    from engine.exact.models import ModelError

    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(share)
    backend = factory(on_progress)
    backend.memory_share = share
    memory = backend.memory()
    if memory["needed_gb"] > share * memory["available_gb"]:
        raise ModelError(f"the models need {memory['needed_gb']:.2f} GiB, more than this engine's share of the "
                         f"device ({share:.2f} of {memory['available_gb']:.1f} GiB): give it a larger share with "
                         "--local-memory")
    return backend


class SplitEngines:
    """engine.backend.Backend over two engine processes: `baseline` serves the baseline engine (it loads the target
    alone), `speculative` everything else."""

    def __init__(self, baseline: EngineProcess, speculative: EngineProcess):
        self.baseline_engines, self.speculative_engines = baseline, speculative
        self.name = speculative.name
        # each engine owns its share of a GPU: fair mode runs them at once; on a CPU they share the cores
        on_gpu = speculative.memory()["device"].startswith("cuda")
        self.capabilities = replace(speculative.capabilities, fair_strategy="parallel" if on_gpu else "alternate")

    @classmethod
    def start(cls, baseline: Callable, speculative: Callable, shares: tuple[float, float],
              on_progress: Progress | None = None) -> "SplitEngines":
        """Start the two engine processes (`baseline`, `speculative`: picklable factories), one after the other: the
        speculative one measures the policy's costs as it starts, and the other's loading would disturb that."""
        from functools import partial

        started: list[EngineProcess] = []
        try:
            for role, factory, share in (("baseline", baseline, shares[0]), ("speculative", speculative, shares[1])):
                process = EngineProcess(partial(with_memory_share, share, factory), f"{role} engine process")
                started.append(process.start(on_progress))
        except BaseException:
            for process in started:
                process.close()
            raise
        return cls(*started)

    def baseline(self, req, cancel: threading.Event | None = None, clock=time.perf_counter) -> Iterator[Event]:
        return self.baseline_engines.baseline(req, cancel, clock)

    def speculative(self, req, cancel: threading.Event | None = None, clock=time.perf_counter,
                    engine: str = "speculative") -> Iterator[Event]:
        return self.speculative_engines.speculative(req, cancel, clock, engine)

    def validate(self, req) -> None:
        self.speculative_engines.validate(req)

    def ignored_settings(self, req) -> tuple[str, ...]:
        return self.speculative_engines.ignored_settings(req)

    def score(self, req, outputs: list[list[int]]) -> list[list[float]]:
        return self.speculative_engines.score(req, outputs)

    def describe(self) -> dict:
        return self.speculative_engines.describe()

    def memory(self) -> dict | None:
        """Each engine process's memory and share, and the two together."""
        parts = {"baseline": self.baseline_engines.memory(), "speculative": self.speculative_engines.memory()}
        total = parts["speculative"] | {"needed_gb": sum(p["needed_gb"] for p in parts.values())}
        return total | {"engines": parts}

    def drafting(self) -> Drafting | None:
        return self.speculative_engines.drafting()

    def reconfigure(self, drafting: Drafting) -> None:
        self.speculative_engines.reconfigure(drafting)

    def variants(self) -> dict[str, dict]:
        return self.speculative_engines.variants()

    def calibration(self) -> dict:
        return self.speculative_engines.calibration()

    def recalibrate(self) -> dict:
        return self.speculative_engines.recalibrate()

    def why_float32(self) -> str | None:
        return self.speculative_engines.why_float32()

    def throughput(self, engine: str, prompts: list[str], max_new_tokens: int,
                   cancel: threading.Event | None = None) -> tuple[int, float]:
        return self.speculative_engines.throughput(engine, prompts, max_new_tokens, cancel)

    def close(self) -> None:
        self.baseline_engines.close()
        self.speculative_engines.close()
