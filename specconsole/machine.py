"""Was the machine quiet during a run? CPU time that other processes used meanwhile makes its timings suspect.

On a 2-core laptop a browser showing the page, a compile or a second run can take half the machine; the engines
then run slower than they would alone, and the run's figures say so instead of passing for the engine's speed.
"""

from __future__ import annotations

import os
import threading
import time

import psutil

# CPU use (in cores) by others during a run above which its timings are marked noisy: on a 2-core machine whose
# engines use both cores, 0.1 core taken by others slows a pass by about 5 %
NOISY_CORES = 0.1


def _thread_cpu_s(native_id: int) -> float:
    """CPU seconds of one thread of this process (Linux's per-thread CPU clock: MAKE_THREAD_CPUCLOCK(tid, SCHED))."""
    return time.clock_gettime(((~native_id) << 3) | 6)


class ConsoleWork:
    """CPU time that the console's own Python threads other than the engines' spend while an engine's pass is timed:
    the page's rendering, Gradio's serialisation, history saves. Such work runs on the cores the pass is measured on,
    so it slows the engine whose pass it overlaps. Native threads (torch's and the tokenizer's pools) count as the
    engines': only the engine threads start work in them."""

    def __init__(self):
        self.engine_ids: set[int] = set()
        self.timed_s = 0.0  # what the console's other threads used during timed passes
        self._mark: float | None = None

    def add_engine_thread(self) -> None:
        """Called by each thread that runs an engine."""
        self.engine_ids.add(threading.get_native_id())

    def _others_s(self) -> float:
        total = 0.0
        for t in threading.enumerate():
            if t.native_id is not None and t.native_id not in self.engine_ids:
                try:
                    total += _thread_cpu_s(t.native_id)
                except (OSError, AttributeError):  # the thread ended meanwhile; no such clock (not Linux): 0
                    pass
        return total

    def start(self) -> None:
        """A timed pass starts."""
        self._mark = self._others_s()

    def stop(self) -> None:
        """The timed pass ended."""
        if self._mark is not None:
            # a thread that ended during the pass takes its time along: never count a negative share
            self.timed_s += max(0.0, self._others_s() - self._mark)
            self._mark = None


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _own_s() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


def _servers_s() -> dict[int, float]:
    """CPU seconds of each process this console started (the managed vLLM and llama.cpp servers: the engines of
    those backends, whose work is the run's own, not a disturbance)."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


class MachineLoad:
    """Started with a run; `result()` at its end: other processes' CPU use and the verdict."""

    def __init__(self):
        self.start_wall, self.start_busy, self.start_own = time.perf_counter(), _busy_s(), _own_s()
        self.start_servers = _servers_s()
        self.console = ConsoleWork()

    def result(self, timed_s: float | None = None) -> dict:
        """`timed_s`: the wall seconds during which passes were timed (fair mode: the sum of the turns); the
        console's own work during them is averaged over that time. Default: the whole run (race mode)."""
        wall = max(time.perf_counter() - self.start_wall, 1e-6)
        # the console's processes that ran through the whole run (a process started or ended meanwhile is another's)
        servers = sum(t - self.start_servers[pid] for pid, t in _servers_s().items() if pid in self.start_servers)
        own = (_own_s() - self.start_own + servers) / wall
        other = max(0.0, (_busy_s() - self.start_busy) / wall - own)
        timed_s = timed_s or wall
        page = self.console.timed_s / max(timed_s, 1e-6)
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        reasons = []
        if other + page > NOISY_CORES:
            reasons.append(f"other processes used {other:.2f} and the console's page {page:.2f} of {cores} cores")
        if load > 1.5 * cores:
            reasons.append(f"load average {load:.1f} on {cores} cores")
        return {"noisy": bool(reasons), "noise": "; ".join(reasons) or None, "other_cores": round(other, 3),
                "console_cores": round(own, 3), "page_cores": round(page, 3),
                "page_cpu_s": round(self.console.timed_s, 4), "timed_s": round(timed_s, 4),
                "load_average": round(load, 2)}
