"""The machine's memory bandwidth as a benchmark runs, to tell its slow spells from its fast ones.

Our 2-core VMs switch, for half a minute to a few minutes at a time, between two memory bandwidths: on the AMD EPYC
Zen 4 a 1 GiB read ran at about 36 GB/s or about 63 GB/s (2026-12-06), nothing else running. A decoding step of our
int4 target then took about 38.9 or 30.7 ms, llama.cpp's about 31.5 or 28.5 (docs/llamacpp.md): our engine slows more
in the slow spells, so a ratio against llama.cpp depends on the spell it was measured in. A benchmark reads the
bandwidth before and after each repeat and reports its ratios per spell.
"""

from __future__ import annotations

import math
import time

import torch

PROBE_MIB = 512  # far larger than any cache here
# two readings further apart than this are two spells; one repeat's own two readings closer than STEADY were in one
SPELLS = 1.25
STEADY = 1.1


class Probe:
    def __init__(self, mib: int = PROBE_MIB):
        self.buffer = torch.ones(mib << 18)  # float32: 4 bytes each

    def gbs(self) -> float:
        """GB/s of the fastest of three reads of the buffer (a sum: one pass over it)."""
        fastest = math.inf
        for _ in range(3):
            t = time.perf_counter()
            self.buffer.sum()
            fastest = min(fastest, time.perf_counter() - t)
        return self.buffer.nbytes / fastest / 1e9


def steady(reading: tuple[float, float]) -> bool:
    """Whether a repeat's two readings agree: it ran within one spell."""
    return max(reading) <= STEADY * min(reading)


def split(readings: list[tuple[float, float]]) -> float | None:
    """The bandwidth that separates slow spells from fast ones, from each repeat's (before, after) readings: the
    geometric middle of the slowest and the fastest steady repeat, or None when they lie within SPELLS of each other
    (one spell) or no repeat was steady."""
    lows = [min(r) for r in readings if steady(r)]
    if not lows or max(lows) <= SPELLS * min(lows):
        return None
    return math.sqrt(min(lows) * max(lows))


def spell(reading: tuple[float, float], threshold: float | None) -> str:
    """"slow", "fast" or "mixed" (the spell changed during the repeat); "one" where the run had one spell."""
    if threshold is None:
        return "one"
    if not steady(reading):
        return "mixed"
    return "fast" if min(reading) >= threshold else "slow"
