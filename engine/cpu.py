"""The CPU this process runs on, as Linux describes it in /proc/cpuinfo (read once): its model name and its
instruction-set flags. What is measured or built per machine is keyed by it (the policy's calibration, the
llama-server build's probe), and the benchmarks name it."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Cpu:
    model: str  # "AMD EPYC"; platform.processor() (or "unknown CPU") where /proc/cpuinfo is missing
    flags: str  # the first processor's flags line as Linux writes it; "" where unknown

    @property
    def flag_set(self) -> frozenset[str]:
        return frozenset(self.flags.split())


@functools.cache
def cpu() -> Cpu:
    model, flags = None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and flags is None:
                flags = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return Cpu(model or platform.processor() or "unknown CPU", flags or "")
