"""Was the machine quiet during a run? CPU time that other processes used meanwhile makes its timings suspect.

On a 2-core laptop a browser showing the page, a compile or a second run can take half the machine; the engines
then run slower than they would alone, and the run's figures say so instead of passing for the engine's speed.
"""

from __future__ import annotations

import os
import time

import psutil

NOISY_CORES = 0.3  # other processes' average CPU use (in cores) above which a run's timings are marked noisy


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _own_s() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


class MachineLoad:
    """Started with a run; `result()` at its end: other processes' CPU use and the verdict."""

    def __init__(self):
        self.start_wall, self.start_busy, self.start_own = time.perf_counter(), _busy_s(), _own_s()

    def result(self) -> dict:
        wall = max(time.perf_counter() - self.start_wall, 1e-6)
        own = (_own_s() - self.start_own) / wall
        other = max(0.0, (_busy_s() - self.start_busy) / wall - own)
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        reasons = []
        if other > NOISY_CORES:
            reasons.append(f"other processes used {other:.2f} of {cores} cores")
        if load > 1.5 * cores:
            reasons.append(f"load average {load:.1f} on {cores} cores")
        return {"noisy": bool(reasons), "noise": "; ".join(reasons) or None, "other_cores": round(other, 3),
                "console_cores": round(own, 3), "load_average": round(load, 2)}
