"""Runs the baseline and the speculative engine on one request, side by side, and saves the run.

Two modes, shown and saved with every run:
- fair: the engines take turns, one target forward pass each, so they never compete for the CPU (or GPU); each
  engine's timings come from a clock that stands still while the other engine computes. The page's own work stays
  out of the timed passes too: a turn's events reach the page after the turn; the page builds its HTML and charts
  under `ui_lock`, which the engines take around each turn; and a turn starts only once Gradio has serialised the
  page's last update (`page_idle`). What the console's other threads still spend during timed passes is counted
  (specconsole.machine.ConsoleWork) and marks the run noisy when it matters.
- race: both engines run at once in two threads, on wall-clock time, sharing the machine (the local engine
  process computes one pass at a time: there their passes take turns as they come, engine.process.child).

An N-way comparison adds up to three more speculative engines, "speculative-2" .. "speculative-4", each
with its own drafting settings and label (specconsole.variants), or on vLLM each served by a speculative server of
its own (Variant.server). The first speculative engine keeps its name. Fair mode takes turns across all engines,
one target pass each; race mode runs them all at once.

While the run goes on, poll() appends the new events to the history about once a second (under `ui_lock`, so never
during a timed pass), so that a killed console leaves what the run had streamed; the end of the run saves the rest.
A write that fails (a full disk) is reported in `save_error`; the run itself goes on and stays on screen.

A backend says how it is fair (`capabilities.fair_strategy`): the local backend alternates passes; vLLM servers that own their
cores or GPU share run in parallel; servers someone else runs are asked one after the other.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, replace

from engine.backend import ENGINES, MAX_EXTRA, extra_engine
from engine.clock import EngineClock
from engine.comparison import ComparisonFigures
from engine.drafting import SERVER_SETTINGS
from engine.analysis.check import sampling_check
from engine.events import Event, PolicyEvent, Reclassified, RunResult, StepRecord, TokenEvent
from engine.metrics import compare, run_metrics
from specconsole.history import EventLog, History, HistoryError
from specconsole.machine import MachineLoad
from specconsole.variants import Variant

log = logging.getLogger(__name__)

MODES = ("fair", "race")
RUN_META = ("backend", "target_model", "draft_model", "method")  # what a backend's describe() saves with a run
SAVE_EVERY_S = 1.0  # how often a running comparison appends its new events to the history
PAGE_WAIT_S = 3.0  # the longest a fair turn waits for the page to hand its last update over
THREAD_END_WAIT_S = 5.0  # at the end of a run: the longest its figures wait for an engine thread to finish its turn


class TurnLock:
    """A lock taken in the order it was asked for. threading.Lock is not fair: the fair-mode engine thread releases it
    after a pass and takes it again at once, which can keep the page (and the saves that keep a killed run's tokens)
    waiting for seconds on a busy machine. Here whoever asked first goes next: at most one pass waits in between."""

    def __init__(self):
        self._turns = threading.Condition()
        self._next_ticket = 0
        self._serving = 0  # the ticket that holds (or may take) the lock

    def __enter__(self) -> "TurnLock":
        with self._turns:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._turns.wait_for(lambda: self._serving == ticket)
        return self

    def __exit__(self, *exc) -> None:
        with self._turns:
            self._serving += 1
            self._turns.notify_all()

    def locked(self) -> bool:
        with self._turns:
            return self._serving < self._next_ticket


class LiveRun:
    """One engine's events so far, as a RunResult whose metrics can be read mid-run. It keeps its own copies of the
    tokens, so that a Reclassified event (vLLM's kinds, told at the end) changes them here and nowhere else; the
    page and the history see the change by comparing kinds (render.PanelFeed, history.EventLog)."""

    def __init__(self, engine: str):
        self.engine = engine
        self.result = RunResult(engine=engine, method="", prompt_tokens=0)
        self.finished = False

    def apply(self, event: Event) -> None:
        if isinstance(event, RunResult):
            # a backend names every speculative result "speculative": keep this engine's own name
            self.result, self.finished = replace(event, engine=self.engine), True
            return
        if isinstance(event, Reclassified):
            event.apply(self.result.tokens)
        elif isinstance(event, TokenEvent):
            self.result.tokens.append(replace(event))
        elif isinstance(event, StepRecord):
            self.result.steps.append(event)
        elif isinstance(event, PolicyEvent):
            self.result.policy.append(event)
        else:
            raise TypeError(f"not an engine event: {event!r}")

    def snapshot(self) -> RunResult:
        if not self.finished:
            r = self.result
            last = max([t.time_s for t in r.tokens] + [s.time_s for s in r.steps], default=0.0)
            r.total_s = last
            r.metrics = run_metrics(r)
        return self.result


class Comparison:
    """One request on the baseline and the speculative engine(s). start() returns at once; poll() drains the events
    that have arrived. `extra`: more speculative configurations (specconsole.variants.Variant), at most MAX_EXTRA."""

    def __init__(self, backend, request, mode: str, history: History | None, meta: dict, first: str = "baseline",
                 extra: list[Variant] | tuple = (), label: str | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if len(extra) > MAX_EXTRA:
            raise ValueError(f"at most {MAX_EXTRA} extra speculative engines, got {len(extra)}")
        self.backend, self.request, self.mode, self.history = backend, request, mode, history
        self.meta = meta
        self.engines = (*ENGINES, *[extra_engine(i) for i in range(len(extra))])
        # each engine's own request (the extras differ in their drafting settings only) and its name on screen
        self.requests = {"baseline": request, "speculative": request,
                         **{extra_engine(i): v.request for i, v in enumerate(extra)}}
        self.labels = {"baseline": "baseline", "speculative": label or request.drafting.method,
                       **{extra_engine(i): v.label for i, v in enumerate(extra)}}
        # the backend's own engine behind each extra one, where it has them (vLLM: one server per config)
        self.servers = {extra_engine(i): v.server for i, v in enumerate(extra) if v.server}
        self.methods = {extra_engine(i): v.method for i, v in enumerate(extra) if v.method}
        # fair mode's turn order: suites alternate it between repeats, so that drift over time cancels
        self.order = (first, *[e for e in self.engines if e != first])
        self.cancel = threading.Event()
        self.events: queue.Queue = queue.Queue()
        self.live = {e: LiveRun(e) for e in self.engines}
        self.run_id: str | None = None
        self.saved = False
        self.save_error: str | None = None
        self.saved_events: EventLog | None = None  # what of this run's events the history has
        self._saved_at = 0.0
        self.ui_lock = TurnLock()
        # clear while the page's last update is being serialised and sent (specconsole.run_stream.hand_over); fair
        # mode's turns wait for it, up to PAGE_WAIT_S (a page that went away must not stall the run)
        self.page_idle = threading.Event()
        self.page_idle.set()
        self.clocks: dict[str, EngineClock] = {}
        self._threads: list[threading.Thread] = []
        self.load: MachineLoad | None = None
        self.machine: dict = {}  # other processes' CPU use during the run, once it finished
        self.check: dict = {}  # the sampling check (engine.analysis.check), once both engines finished
        self.extra_checks: dict[str, dict] = {}  # the same for each extra speculative engine

    # --- running ---------------------------------------------------------------------------------------------------

    @property
    def strategy(self) -> str:
        """How the engines share the machine: "alternate" (turns of one pass), "sequential" (turns of a whole run) or
        "parallel" (all at once: race mode, or a backend whose engines own their cores)."""
        return self.backend.capabilities.fair_strategy if self.mode == "fair" else "parallel"

    def start(self) -> None:
        self.load = MachineLoad()
        if self.history is not None:
            try:
                self.run_id = self.history.start_run(mode=self.mode, settings=_settings(self.request),
                                                     prompt=self.request.prompt, engines=self.engine_rows(),
                                                     **self.meta)
                self.saved_events = EventLog(self.run_id)
            except HistoryError as e:  # the run goes on, on screen only
                self._save_failed(e)
        strategy = self.strategy
        if strategy != "parallel":
            step = StepRecord if strategy == "alternate" else RunResult
            self._threads = [threading.Thread(target=self._take_turns, args=(step,), daemon=True,
                                              name="specconsole-fair")]
        else:
            self._threads = [threading.Thread(target=self._race, args=(e,), daemon=True, name=f"specconsole-{e}")
                             for e in self.engines]
            self.load.console.start()  # engines at once: every moment of the run is timed
        for t in self._threads:
            t.start()

    def engine_rows(self) -> list[dict]:
        """Who takes part, for the history's engines table: name, label, method and drafting settings."""
        # what ran
        methods = {"baseline": "none", "speculative": self.meta.get("method") or self.request.drafting.method,
                   **self.methods}
        return [{"engine": e, "label": self.labels[e], "method": methods.get(e, self.requests[e].drafting.method),
                 "settings": _settings(self.requests[e])} for e in self.engines]

    def _stream(self, engine: str, clock):
        if engine in self.servers:
            return self.backend.speculative(self.requests[engine], self.cancel, clock, engine=self.servers[engine])
        stream = self.backend.baseline if engine == "baseline" else self.backend.speculative
        return stream(self.requests[engine], self.cancel, clock)

    def _take_turns(self, until: type) -> None:
        """Run one engine until it yields an event of type `until` (a pass, or the whole run), then the next, in
        turn across all engines; each engine's clock runs only during its own turn, and only once the page has
        handed its last update over (page_idle), so that Gradio's serialisation of it runs between turns."""
        self.load.console.add_engine_thread()
        clocks = self.clocks = {e: EngineClock() for e in self.engines}
        streams = {e: self._stream(e, clocks[e]) for e in self.order}
        order = deque(self.order)  # the engines still running, the next turn's first
        after_draw = dict.fromkeys(self.order, 0)  # turns each engine took right after the page drew
        # a pass's events reach the page after the turn, so that nothing wakes up to read them during it; a whole
        # run's (sequential turns) as they come, or the page would not stream
        hold = until is StepRecord
        while order:
            turn = []
            # a pass is timed under ui_lock, so the page's work runs between passes; a whole run is not, or the page
            # (poll() applies events under the lock) could not show it until it ended
            with self.ui_lock if hold else contextlib.nullcontext():
                engine = order.popleft()
                try:
                    # the page is handing an update over: wait for it, then for the browser's drawing of it (in its
                    # processes: wait_until_quiet). A turn that is a whole run (sequential) always waits for quiet:
                    # the page streams during such turns, and its drawing of the comparison's start or of the last
                    # engine's last updates would fall in the next turn.
                    drew = not self.page_idle.is_set() and self.page_idle.wait(PAGE_WAIT_S)
                    if drew:
                        # The turn after a drawing is at a disadvantage (the browser's leftover work, the idle
                        # wait). Updates tend to follow the longest turn, so in strict order it would nearly always
                        # be the same engine's: it goes to the engine that has had it least often.
                        order.appendleft(engine)
                        order.rotate(-order.index(min(order, key=after_draw.get)))
                        engine = order.popleft()
                        after_draw[engine] += 1
                    if drew or not hold:
                        self.load.console.wait_until_quiet()
                    self.load.console.start(engine)
                    clocks[engine].resume()
                    for event in streams[engine]:  # up to the end of this engine's next target pass
                        if hold:
                            turn.append((engine, event))
                        else:
                            self.events.put((engine, event))
                        if isinstance(event, (until, RunResult)):
                            order.append(engine)
                            break
                # an engine that dies is reported and the others go on; so is a failure of the turn's own waiting
                # and measuring, which would otherwise end this thread and leave the run unfinished
                except Exception as e:  # noqa: BLE001
                    turn.append((engine, self._crashed(engine, e)))
                finally:
                    clocks[engine].pause()
                    self.load.console.stop()
            for item in turn:
                self.events.put(item)

    def _race(self, engine: str) -> None:
        self.load.console.add_engine_thread()
        try:
            for event in self._stream(engine, time.perf_counter):
                self.events.put((engine, event))
        except Exception as e:  # noqa: BLE001
            self.events.put((engine, self._crashed(engine, e)))

    def _crashed(self, engine: str, error: Exception) -> RunResult:
        log.exception("%s engine crashed", engine)
        result = RunResult(engine=engine, method="", prompt_tokens=0, finish_reason="error",
                           error=f"{type(error).__name__}: {error}")
        result.metrics = run_metrics(result)
        return result

    # --- reading ---------------------------------------------------------------------------------------------------

    def poll(self, timeout: float = 0.1) -> bool:
        """Apply the events that arrived (waiting up to `timeout` for the first); True when both engines finished."""
        try:
            arrived = [self.events.get(timeout=timeout)]
        except queue.Empty:
            arrived = []
        with self.ui_lock:  # fair mode: the events of a turn are applied once the turn is over, not during it
            try:
                while True:
                    arrived.append(self.events.get_nowait())
            except queue.Empty:
                pass
            for engine, event in arrived:
                self.live[engine].apply(event)
        done = all(r.finished for r in self.live.values())
        if not done:
            self._save_progress()
        if done and self.load is not None and not self.machine:
            # an engine's last event arrives before its thread has stopped the turn's clock (whole-run turns) or left
            # its stream: the figures wait for that, and only one thread ever stops the console's clock
            for t in self._threads:
                t.join(THREAD_END_WAIT_S)
            if self.strategy == "parallel":
                self.load.console.stop()
            self.machine = self.load.result(sum(c.elapsed for c in self.clocks.values()) if self.clocks else None)
        if done and not self.saved:
            self._save()
        return done

    @property
    def results(self) -> dict[str, RunResult]:
        return {e: self.live[e].snapshot() for e in self.engines}

    def comparison(self, results: dict[str, RunResult] | None = None) -> ComparisonFigures:
        """The main speculative engine against the baseline (the two-engine figures)."""
        r = results or self.results
        return compare(r["baseline"], r["speculative"], self.request.sampling.greedy)

    def comparisons(self, results: dict[str, RunResult] | None = None) -> dict[str, ComparisonFigures]:
        """Every speculative engine against the baseline: speedup, identical / first divergence, bounds, ..."""
        r = results or self.results
        return {e: compare(r["baseline"], r[e], self.request.sampling.greedy) for e in self.engines[1:]}

    def checks(self) -> dict[str, dict]:
        """What the console checked beside each speculative engine's figures once the run ended: the machine's load
        during the run (specconsole.machine) and the sampling check (engine.analysis.check). Plain dicts under
        those modules' keys, a concern of their own: the history saves them beside the figures."""
        return {e: self.machine | (self.check if e == "speculative" else self.extra_checks.get(e, {}))
                for e in self.engines[1:]}

    @property
    def status(self) -> str:
        results = self.results
        if any(r.error for r in results.values()):
            return "failed"
        if self.cancel.is_set() or any(r.finish_reason == "cancelled" for r in results.values()):
            return "cancelled"
        return "completed"

    @property
    def error(self) -> str | None:
        errors = [f"{e}: {r.error}" for e, r in self.results.items() if r.error]
        return "; ".join(errors) or None

    def _save_progress(self) -> None:
        """Append the events that came since the last save, at most once every SAVE_EVERY_S."""
        if self.saved_events is None or time.monotonic() - self._saved_at < SAVE_EVERY_S:
            return
        self._saved_at = time.monotonic()
        with self.ui_lock:  # fair mode: between two timed passes, like the page's own work
            try:
                self.history.save_events(self.saved_events, {e: self.live[e].result for e in self.engines})
            except HistoryError as e:  # tried again at the next save: nothing is counted as saved
                self._save_failed(e)

    def _save(self) -> None:
        self.saved = True
        results = self.results
        self.check = sampling_check(self.backend, self.request, results)  # all finished: nothing is timed
        for e in self.engines[2:]:
            self.extra_checks[e] = sampling_check(self.backend, self.requests[e],
                                                  {"baseline": results["baseline"], "speculative": results[e]})
        if self.history is None or self.saved_events is None:
            return
        try:
            comparisons = self.comparisons(results)
            self.history.finish_run(self.run_id, self.status, results, comparisons["speculative"], self.error,
                                    saved=self.saved_events, comparisons=comparisons, checks=self.checks())
            self.save_error = None  # a failed save during the run was made good: everything is in
        except Exception as e:  # noqa: BLE001 - never lose the on-screen result because the disk failed
            self._save_failed(e)

    def _save_failed(self, error: Exception) -> None:
        if self.save_error is None:  # once per run: a full disk fails every save after the first
            log.error("could not save run %s: %s", self.run_id, error, exc_info=not isinstance(error, HistoryError))
        self.save_error = (f"Not saved in the history: {error}. The run stays on screen and the runs saved before "
                           "are kept; once the file can be written again (free disk space), the next run is saved.")


def run_meta(backend, request) -> dict:
    """Who served a run, saved with it: the backend's description and the drafting method that actually ran. Where
    the backend applies the request's method (local), that is the request's; where it does not (vLLM), it is the
    one the server was started with, whatever the form or the command line said."""
    meta = {k: v for k, v in backend.describe().items() if k in RUN_META}
    if "method" not in backend.ignored_settings(request):
        meta["method"] = request.drafting.method
        if request.drafting.method == "ngram":  # prompt lookup: no second model took part
            meta["draft_model"] = None
    return meta


def _settings(request) -> dict:
    d = asdict(request)
    d.pop("prompt")
    # saved flat, as one table of settings; a server's restart fields (draft, options) are not a run's
    drafting = {k: v for k, v in d.pop("drafting").items() if k not in SERVER_SETTINGS}
    d = {"max_new_tokens": d.pop("max_new_tokens")} | drafting | d
    d.update(d.pop("sampling"))
    d["stop_strings"] = list(d["stop_strings"])
    return d
