"""Was the machine quiet during a run? CPU time that others used while the engines computed makes its timings suspect.

The engines are the processes the console started (the engine process of our own engines, managed vLLM and llama.cpp
servers) with the console's threads that drive them, or this process where a backend runs in it (tests, benchmarks of
the kernels). Everything else is "other": the console's other threads (Gradio, the page's updates, the history), the
browser drawing the page, a compile, a second run. Noise is what others take during
the engines' timed passes: on a 2-core laptop a browser, a compile or a second run can take half the machine, the
engines then run slower than they would alone, and the run's figures say so. What the page costs between two passes,
while the engines wait for it, is not noise: it is reported as the time the engines waited (fair mode).
"""

from __future__ import annotations

import os
import threading
import time

import psutil

# CPU use (in cores) by others during a run above which its timings are marked noisy: on a 2-core machine whose
# engines use both cores, 0.1 core taken by others slows a pass by about 5 %
NOISY_CORES = 0.1
# before a timed pass that follows the page's drawing: how long other processes must take no CPU, and the longest wait
QUIET_WINDOW_S = 0.02
QUIET_LIMIT_S = 0.2
IDLE_COUNT_S = 1 / os.sysconf("SC_CLK_TCK")  # the unit in which Linux reports the CPUs' idle time (10 ms)
PIPE = "engine-pipe"  # the thread name of an engine process's pipe reader in this process


def _cpu_clock_s(ident: int, thread: bool = False) -> float:
    """CPU seconds, to the nanosecond, of the process `ident` or (thread=True) of this process's thread `ident` (its
    native id): Linux's CPU clocks, MAKE_PROCESS_CPUCLOCK(pid, SCHED) and MAKE_THREAD_CPUCLOCK(tid, SCHED)."""
    return time.clock_gettime(((~ident) << 3) | (6 if thread else 2))


class ConsoleWork:
    """What disturbs the engines while their passes are timed (fair mode: each turn's start() and stop()):
    - the CPU time of the console's own Python threads other than the engines': the page's rendering, Gradio's
      serialisation, history saves. Native threads (torch's and the tokenizer's pools) count as the engines': only
      the engine threads start work in them;
    - per engine, the CPU time of other processes (a browser showing the page) during that engine's passes: a
      disturbance that lands on one engine's passes more than on the other's biases the speedup, not only the
      speeds. Linux reports the machine's idle time in counts of 10 ms, so one pass reads coarsely; summed over a
      run's passes the figure is unbiased."""

    def __init__(self, servers: list[psutil.Process] | None = None):
        self.engine_ids: set[int] = set()
        self.timed_s = 0.0  # what the console's other threads used during timed passes
        self.servers = servers or []  # the processes this console started: their work is the engines'
        self.passes_s: dict[str, float] = {}  # engine -> wall seconds of its timed passes
        self.others_s: dict[str, float] = {}  # engine -> other processes' CPU seconds during them
        self.quiet_misses = 0  # waits for a quiet machine that ran out, in a row
        self.quiet_given_up = False
        self._mark: float | None = None
        self._outside: tuple[str, float, float] | None = None  # (engine, wall, CPU outside the console) at start

    def add_engine_thread(self) -> None:
        """Called by each thread that runs an engine."""
        self.engine_ids.add(threading.get_native_id())

    def _others_s(self) -> float:
        total = 0.0
        for t in threading.enumerate():
            # the engine process's pipe reader (engine.process.client) hands the engines' events over: engine work
            if t.native_id is not None and t.native_id not in self.engine_ids and not t.name.startswith(PIPE):
                try:
                    total += _cpu_clock_s(t.native_id, thread=True)
                except (OSError, AttributeError):  # the thread ended meanwhile; no such clock (not Linux): 0
                    pass
        return total

    def _outside_console_s(self) -> float:
        """CPU seconds the machine spent busy outside this console and its servers (its engine process among them);
        the console's own threads other than the engines' are counted apart (`timed_s`)."""
        return _busy_s() - _own_s() - sum(_servers_s(self.servers).values())

    def start(self, engine: str | None = None) -> None:
        """A timed pass starts (`engine`: whose, when only one engine runs at a time)."""
        self._mark = self._others_s()
        if engine is not None:
            self._outside = (engine, time.perf_counter(), self._outside_console_s())

    def stop(self) -> None:
        """The timed pass ended."""
        if self._mark is not None:
            # a thread that ended during the pass takes its time along: never count a negative share
            self.timed_s += max(0.0, self._others_s() - self._mark)
            self._mark = None
        if self._outside is not None:
            engine, wall, outside = self._outside
            self.passes_s[engine] = self.passes_s.get(engine, 0.0) + time.perf_counter() - wall
            # Summed as read, negative steps too: the counters of the machine (idle time in counts of 10 ms) and of
            # the processes (their threads' run time, brought up to date when they stop or a tick lands) disagree
            # over one short pass either way, and cutting off the negative side would count a quiet run as busy.
            # Only the sum over the run is read, and it is unbiased.
            self.others_s[engine] = self.others_s.get(engine, 0.0) + self._outside_console_s() - outside
            self._outside = None

    def wait_until_quiet(self) -> None:
        """Wait until other processes have taken no CPU for QUIET_WINDOW_S, at most QUIET_LIMIT_S. Called before a
        timed turn when the page has just drawn an update (its browser still composites the frame in other threads
        and processes, and a pass timed meanwhile would carry that work), and before every turn that is a whole run.
        On a machine that is never quiet (a compile, a second run) the wait gives up after it ran out twice in a
        row, for the rest of the run."""
        if self.quiet_given_up:
            return
        start = time.perf_counter()
        last = self._outside_console_s()
        while time.perf_counter() - start < QUIET_LIMIT_S:
            time.sleep(QUIET_WINDOW_S)
            now = self._outside_console_s()
            if now - last < IDLE_COUNT_S:  # others took no CPU in the window, to the idle count's resolution
                self.quiet_misses = 0
                return
            last = now
        self.quiet_misses += 1
        self.quiet_given_up = self.quiet_misses >= 2

    def others_in_passes(self) -> dict[str, float]:
        """Per engine: other processes' CPU use (cores) during its timed passes (never below zero: the machine's and
        the processes' clocks disagree over short passes either way; and a server that ends during a pass takes its
        whole CPU time out of the engines' count, which then reads as others')."""
        return {e: round(max(0.0, self.others_s[e]) / max(s, 1e-6), 3) for e, s in self.passes_s.items()}


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy: its CPUs' time less their idle time. Linux measures idle time
    exactly (from each entry into idle to its exit) and reports it in counts of IDLE_COUNT_S; the busy categories
    are sampled at the timer's ticks, too coarse for passes of a few milliseconds: summed over a run of such passes,
    their sampling error alone read as a tenth of a core taken by others on a quiet machine."""
    cpus = psutil.cpu_times(percpu=True)
    return len(cpus) * time.monotonic() - sum(c.idle + getattr(c, "iowait", 0.0) for c in cpus)


def _own_s() -> float:
    return time.process_time()


def _servers() -> list[psutil.Process]:
    """The processes this console started (the managed vLLM and llama.cpp servers: the engines of those backends,
    whose work is the run's own, not a disturbance)."""
    return psutil.Process().children(recursive=True)


def _servers_s(servers: list[psutil.Process]) -> dict[int, float]:
    """CPU seconds of each of `servers`, from their CPU clocks (/proc/<pid>/stat counts in 10 ms)."""
    out = {}
    for p in servers:
        try:
            out[p.pid] = _cpu_clock_s(p.pid)
        except OSError:  # it ended
            pass
    return out


class MachineLoad:
    """Started with a run; `result()` at its end: other processes' CPU use and the verdict."""

    def __init__(self):
        self.start_wall, self.start_busy, self.start_own = time.perf_counter(), _busy_s(), _own_s()
        self.servers = _servers()
        self.start_servers = _servers_s(self.servers)
        self.console = ConsoleWork(self.servers)

    def result(self, timed_s: float | None = None) -> dict:
        """`timed_s`: the wall seconds during which passes were timed (fair mode: the sum of the turns); the
        console's own work during them is averaged over that time. Default: the whole run (race mode)."""
        wall = max(time.perf_counter() - self.start_wall, 1e-6)
        # the console's processes that ran through the whole run (a process started or ended meanwhile is another's)
        servers = sum(t - self.start_servers[pid] for pid, t in _servers_s(self.servers).items()
                      if pid in self.start_servers)
        own = (_own_s() - self.start_own + servers) / wall
        other = max(0.0, (_busy_s() - self.start_busy) / wall - own)
        timed_s = timed_s or wall
        page = self.console.timed_s / max(timed_s, 1e-6)
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        in_passes = self.console.others_in_passes()
        reasons = []
        if in_passes:  # each pass timed on its own: only what others took during them is noise
            if max(in_passes.values()) + page > NOISY_CORES:
                reasons.append("others used " + ", ".join(f"{v:.2f}" for v in in_passes.values())
                               + f" of {cores} cores during the passes of " + ", ".join(in_passes))
        elif other + page > NOISY_CORES:  # engines at once: the whole run is timed
            reasons.append(f"other processes used {other:.2f} and the console's page {page:.2f} of {cores} cores")
        if load > 1.5 * cores:
            reasons.append(f"load average {load:.1f} on {cores} cores")
        return {"noisy": bool(reasons), "noise": "; ".join(reasons) or None, "other_cores": round(other, 3),
                "console_cores": round(own, 3), "page_cores": round(page, 3),
                "page_cpu_s": round(self.console.timed_s, 4), "timed_s": round(timed_s, 4),
                # fair mode: the wall time outside the engines' turns (the page's drawing, the hand-over between
                # passes): what the page costs, not noise
                "waited_s": round(max(0.0, wall - timed_s), 4),
                "load_average": round(load, 2), "others_in_passes": in_passes}
