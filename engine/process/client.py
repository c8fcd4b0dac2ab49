"""A backend in an engine process of its own: the console's side of the pipe (the other: engine.process.child).

The console holds no model. `EngineProcess` is an engine.backend.Backend whose every call crosses one pipe to a
process that it starts and owns, as the managed vLLM and llama.cpp servers are started and owned. Whatever the
console does (Gradio, its event loop, the page's threads, the history) runs in another process than the engines'
passes, and every front end (the page, `launch.py demo` and `suite`, the Workbench, the benchmarks) drives the same
process the same way.

The process never outlives the console: it ends at the pipe's end-of-file, however the console ended. If the engine
process dies (killed, out of memory, a crash in a kernel), the run in progress ends with an error RunResult that
keeps what it had streamed and says why, and a fresh engine process starts at once, in the background, for the
next run.
"""

from __future__ import annotations

import itertools
import logging
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from dataclasses import dataclass, field
from typing import Callable, Iterator

from engine.drafting import Drafting
from engine.events import Event, PolicyEvent, RunResult, StepRecord, TokenEvent
from engine.metrics import run_metrics

log = logging.getLogger(__name__)

Progress = Callable[[str, float, float], None]
STOP_WAIT_S = 10.0  # close(): how long the process may take to end before it is killed


class EngineProcessError(RuntimeError):
    """The engine process ended, or could not start; the message says how."""


def exit_reason(exitcode: int | None) -> str:
    """How a process ended, in words: "killed by SIGKILL", "exit code 1"."""
    if exitcode is None:
        return "it stopped answering"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    """The process's exit code once it ended, waiting up to `timeout` s; None if it still runs."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


@dataclass
class _Died:
    """Handed to whoever waits on the pipe when the engine process is gone."""
    reason: str


@dataclass
class _Seen:
    """What a stream has passed on so far: kept for the RunResult of a run whose engine process died."""
    tokens: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    policy: list = field(default_factory=list)

    def add(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.tokens.append(event)
        elif isinstance(event, StepRecord):
            self.steps.append(event)
        elif isinstance(event, PolicyEvent):
            self.policy.append(event)


class EngineProcess:
    """engine.backend.Backend served by a backend that `factory(on_progress)` builds in an engine process.

    `factory` must pickle (a module-level function, or a functools.partial of one): the process is a fresh
    interpreter (`python -m engine.process.child`), not a fork, so that it shares no thread, lock or allocator state
    with the console, and no script's main module is run again in it."""

    def __init__(self, factory: Callable, what: str = "engine process"):
        self.factory, self.what = factory, what
        self.name, self.capabilities, self.pid = "", None, None
        self.info: dict = {}  # what the process said when it was ready (name, capabilities, pid, describe)
        self.restarts = 0
        self.died: str | None = None  # why the last engine process ended, once one did
        self._proc = self._conn = None
        self._lock = threading.RLock()  # the pipe's write end and the table below
        self._waiting: dict[int, queue.Queue] = {}  # this process's calls and streams: id -> where answers go
        self._ids = itertools.count(1)
        self._starting = threading.Lock()  # one start at a time: the first, a restart, or close() waiting for one
        self._closed = False

    # --- the process ------------------------------------------------------------------------------------------------

    def start(self, on_progress: Progress | None = None) -> "EngineProcess":
        """Start the engine process and return once its backend is ready (raises what its loading raised)."""
        with self._starting:
            self._start(on_progress)
        return self

    def _start(self, on_progress: Progress | None) -> None:
        if self._closed:
            raise EngineProcessError(f"the {self.what} was closed")
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-m", "engine.process.child", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()  # only the child holds it now: its end-of-file tells the child that the console is gone
        conn = Connection(ours.detach())
        try:
            conn.send(sys.path)  # first, so that the factory's module imports there as here
            conn.send(self.factory)
            message = self._wait_ready(conn, proc, on_progress)
        except BaseException:
            conn.close()
            if _wait(proc, STOP_WAIT_S) is None:  # (a process that failed to load ends by itself)
                proc.kill()
                _wait(proc, 5)
            raise
        waiting: dict[int, queue.Queue] = {}
        with self._lock:
            self._proc, self._conn, self._waiting, self.died = proc, conn, waiting, None
            self.info = message[1]
            self.name, self.capabilities, self.pid = self.info["name"], self.info["capabilities"], self.info["pid"]
        threading.Thread(target=self._read, args=(conn, proc, waiting), daemon=True, name="engine-pipe").start()
        log.info("%s %d ready", self.what, proc.pid)

    def _wait_ready(self, conn, proc, on_progress: Progress | None) -> tuple:
        """Relay the loading's progress; return the "ready" message, or raise why there is none."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                raise EngineProcessError(f"the {self.what} ended while loading ({exit_reason(_wait(proc, 5))})")
            if message[0] == "progress" and on_progress is not None:
                on_progress(*message[1:])
            elif message[0] == "failed":
                raise message[1]
            elif message[0] == "ready":
                return message

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self.died is None

    def _read(self, conn, proc, waiting: dict) -> None:
        """Hand each of this process's answers to whoever waits for it, until its pipe ends; then tell them all why."""
        try:
            while True:
                message = conn.recv()
                with self._lock:
                    answers = waiting.get(message[1])
                if answers is not None:
                    answers.put(message)
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 - an answer that does not unpickle: the process cannot be trusted on
            log.exception("the %s sent what cannot be read; stopping it", self.what)
            proc.kill()
        reason = f"the {self.what} ended ({exit_reason(_wait(proc, 5))})"
        with self._lock:
            current = self._proc is proc
            if current:
                self.died = reason
            stranded = list(waiting.values())
            waiting.clear()
        for answers in stranded:
            answers.put(_Died(reason))
        if current and not self._closed:
            log.error("%s; starting a fresh one", reason)
            threading.Thread(target=self._restart, daemon=True, name="engine-restart").start()

    def _restart(self) -> None:
        """A fresh engine process after one died, unless one was started meanwhile or the console is closing."""
        try:
            self._ready(lambda stage, done, total: log.info("restarting the engines: %s", stage))
        except Exception:  # noqa: BLE001 - the next call tries again and says why
            log.exception("the fresh %s did not start", self.what)

    def _ready(self, on_progress: Progress | None = None) -> None:
        """Before each call: start a fresh engine process where the last one is gone (or wait for the start under
        way)."""
        with self._starting:
            if self._closed:
                raise EngineProcessError(f"the {self.what} was closed")
            if not self.alive:
                self._start(on_progress)
                self.restarts += 1

    def _send(self, message) -> None:
        with self._lock:
            self._tell(message)

    def _ask(self, key: int, message) -> tuple[queue.Queue, dict]:
        """Send `message`; return the queue its answers (or a _Died) arrive in, and the table it waits in."""
        answers: queue.Queue = queue.Queue()
        with self._lock:
            waiting = self._waiting
            if self.died is None:
                waiting[key] = answers
                if self._tell(message):
                    return answers, waiting
            answers.put(_Died(self.died or f"the {self.what} ended"))
        return answers, waiting

    def _tell(self, message) -> bool:
        """Send under the lock; False where the pipe is broken (the reader then reports why)."""
        try:
            self._conn.send(message)
            return True
        except (OSError, ValueError):
            return False

    def _call(self, name: str, *args):
        self._ready()
        cid = next(self._ids)
        answers, waiting = self._ask(cid, ("call", cid, name, args))
        answer = answers.get()
        with self._lock:
            waiting.pop(cid, None)
        if isinstance(answer, _Died):
            then = "it was closed" if self._closed else "a fresh one is starting: try again"
            raise EngineProcessError(f"{answer.reason}; {then}")
        _, _, value, error = answer
        if error is not None:
            raise error
        return value

    def close(self) -> None:
        """Stop the engine process (killed if it does not end within STOP_WAIT_S); safe to call twice, and while a
        fresh one is starting (that one is stopped once it is up)."""
        self._closed = True
        with self._starting:
            proc, conn = self._proc, self._conn
        if proc is None:
            return
        if proc.poll() is None:
            self._send(("stop",))
        if _wait(proc, STOP_WAIT_S) is None:
            proc.kill()
            _wait(proc, 5)
        conn.close()

    # --- the Backend protocol ---------------------------------------------------------------------------------------

    def baseline(self, req, cancel: threading.Event | None = None, clock=time.perf_counter) -> Iterator[Event]:
        """The clock is the engine process's own: it runs only while the stream computes (engine.process.child)."""
        return self._stream("baseline", req, cancel, None)

    def speculative(self, req, cancel: threading.Event | None = None, clock=time.perf_counter,
                    engine: str = "speculative") -> Iterator[Event]:
        return self._stream("speculative", req, cancel, engine)

    def _stream(self, kind: str, req, cancel, engine) -> Iterator[Event]:
        self._ready()
        sid = next(self._ids)
        seen, cancelled = _Seen(), False
        answers, waiting = self._ask(sid, ("stream", sid, kind, req, engine))
        try:
            while True:
                if cancel is not None and cancel.is_set() and not cancelled:
                    self._send(("cancel", sid))
                    cancelled = True
                if answers.empty():  # (a _Died is already there)
                    self._send(("next", sid))
                answer = answers.get()
                if isinstance(answer, _Died):
                    method = "none" if kind == "baseline" else req.drafting.method
                    yield self._died_result(kind, method, seen, answer.reason)
                    return
                _, _, events, error, done = answer
                for event in events:
                    seen.add(event)
                    yield event
                if error is not None:
                    raise error
                if done:
                    if not (events and isinstance(events[-1], RunResult)):
                        raise EngineProcessError(f"the {kind} stream ended without a result")
                    return
        finally:
            with self._lock:
                waiting.pop(sid, None)
                if self.died is None and waiting is self._waiting:
                    self._tell(("close", sid))

    def _died_result(self, kind: str, method: str, seen: _Seen, reason: str) -> RunResult:
        """The RunResult of a run whose engine process died: what it had streamed, and why it ended."""
        result = RunResult(engine=kind, method=method, prompt_tokens=0, tokens=seen.tokens, steps=seen.steps,
                           policy=seen.policy, finish_reason="error",
                           error=f"{reason}. What it had streamed is kept; a fresh engine process is starting for "
                                 "the next run.")
        result.output_ids = [t.token_id for t in result.output_tokens]
        result.output_text = "".join(t.text for t in result.output_tokens)
        result.total_s = max([t.time_s for t in seen.tokens] + [s.time_s for s in seen.steps], default=0.0)
        result.metrics = run_metrics(result)
        return result

    def validate(self, req) -> None:
        self._call("validate", req)

    def ignored_settings(self, req) -> tuple[str, ...]:
        return self._call("ignored_settings", req)

    def score(self, req, outputs: list[list[int]]) -> list[list[float]]:
        return self._call("score", req, outputs)

    def describe(self) -> dict:
        return self._call("describe")

    def memory(self) -> dict | None:
        return self._call("memory")

    def drafting(self) -> Drafting | None:
        return self._call("drafting")

    def reconfigure(self, drafting: Drafting) -> None:
        self._call("reconfigure", drafting)

    def variants(self) -> dict[str, dict]:
        return self._call("variants")

    def throughput(self, engine: str, prompts: list[str], max_new_tokens: int,
                   cancel: threading.Event | None = None) -> tuple[int, float]:
        from engine.limits import SettingsError

        raise SettingsError("the engine process serves one request at a time: the concurrency sweep needs vLLM")

    def why_float32(self) -> str | None:
        """Why the local target runs in float32 where int4 was asked for (None: it runs as asked)."""
        return self._call("why_float32")

    def calibration(self) -> dict:
        """The cost model its policy drafts with (engine.exact.calibration), for the page."""
        return self._call("calibration")

    def recalibrate(self) -> dict:
        """Measure the cost model again, store it, and return it."""
        return self._call("recalibrate")
