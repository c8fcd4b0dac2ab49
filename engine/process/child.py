"""The engine process's side of the pipe: builds the backend, then serves the console's messages.

The console (engine.process.client.EngineProcess) sends, over one duplex pipe:

    ("stream", sid, kind, request, engine)  open a stream: kind "baseline" or "speculative" (engine: which of the
                                            backend's speculative engines)
    ("next", sid)                           run the stream up to the end of its next target pass (a StepRecord) or
                                            its end (the RunResult); answered ("events", sid, events, error, done)
    ("cancel", sid)                         the stream's cancel: it stops after the pass it is in
    ("close", sid)                          drop the stream
    ("call", cid, name, args)               one of the Backend methods in CALLS; answered ("reply", cid, value, error)
    ("stop",)                               end the process

and reads ("progress", stage, done, total) while the models load, then ("ready", info) or ("failed", error).

A stream computes only when asked ("next"), one pass at a time, so that the console decides when each engine runs
(fair mode's turns). Its clock runs only while it computes: the pipe's round trip and whatever the console does
between two passes are not the engine's time.

Every pass of every stream, the backend's build and the calls that run the models run on one thread, the engine
thread, in the order they were asked for (so engines asked for at once, race mode, take turns pass by pass). torch's
OpenMP (libgomp) keeps a pool of worker threads for each thread that ever ran a parallel operation; with two pools
alive it manages more threads than the machine has cores, its workers stop spinning between operations, and each
of the ~1,000 operations of a pass pays a wake-up: a second pool, idle, made the int4 target's one-row step 1.36x
slower on a 2-core Intel Xeon (docs/page-cost.md#one-engine-thread-2026-12-06).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from multiprocessing.connection import Connection
from typing import Callable

from engine.clock import EngineClock
from engine.events import RunResult, StepRecord

log = logging.getLogger(__name__)

# the Backend methods the console may call over the pipe; streams are opened with "stream". Those that run the models
# (or reload them) run on the engine thread, after the passes asked for before them; the others answer at once.
ENGINE_CALLS = ("score", "reconfigure", "recalibrate")
CALLS = ("validate", "ignored_settings", "describe", "memory", "drafting", "variants", "why_float32", "calibration",
         *ENGINE_CALLS)


def portable(error: BaseException) -> BaseException:
    """`error` if it crosses the pipe intact, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any exception that does not pickle
        return RuntimeError(f"{type(error).__name__}: {error}")


class Stream:
    """One engine's run in this process, advanced one pass per "next" on the engine thread."""

    def __init__(self, sid: int, open_run: Callable, send: Callable):
        self.sid, self.open_run, self.send = sid, open_run, send
        self.cancel = threading.Event()  # set by the pipe's reader at once, seen after the pass in progress
        self.clock = EngineClock()
        self.events = None  # the backend's stream, opened by the first "next"
        self.done = False

    def advance(self) -> None:
        """Run up to the end of the next target pass (a StepRecord) or of the run, and send what it made."""
        if self.done:
            return
        batch, error, done = [], None, False
        self.clock.resume()
        try:
            if self.events is None:
                self.events = iter(self.open_run(self.cancel, self.clock))
            for event in self.events:
                batch.append(event)
                if isinstance(event, (StepRecord, RunResult)):
                    break
            else:
                done = True
        except Exception as e:  # noqa: BLE001 - the console reports it as the engine's failure
            error, done = portable(e), True
        finally:
            self.clock.pause()
        if batch and isinstance(batch[-1], RunResult):
            batch[-1].metrics.engine_pid = os.getpid()  # where the passes ran, saved with the run
            done = True
        self.done = done
        try:
            self.send(("events", self.sid, batch, error, done))
        except Exception as e:  # noqa: BLE001 - an event that does not pickle: the run ends, and says why
            self.done = True
            self.send(("events", self.sid, [], portable(e), True))

    def close(self) -> None:
        """Drop the run (a stream closed before its end: its generator's cleanup runs)."""
        self.done = True
        if self.events is not None and hasattr(self.events, "close"):
            self.events.close()


def serve(conn, factory: Callable) -> None:
    """Build the backend with `factory(on_progress)` on the engine thread, then serve `conn` until "stop" or until the
    console is gone (the pipe's end-of-file: however the console ended, SIGKILL included)."""
    from engine.setup import setup

    setup()
    lock = threading.Lock()
    engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")  # the engine thread (module docstring)

    def send(message) -> None:
        """One message to the console; pickled first, so that one that does not pickle raises here, whole."""
        data = pickle.dumps(message)
        with lock:
            conn.send_bytes(data)

    try:
        backend = engine.submit(factory, lambda stage, done, total: send(("progress", stage, done, total))).result()
    except Exception as e:  # noqa: BLE001 - the console shows why the models did not load
        log.exception("the engines did not load")
        send(("failed", portable(e)))
        return
    send(("ready", {"name": backend.name, "capabilities": backend.capabilities, "pid": os.getpid(),
                    "describe": backend.describe()}))
    streams: dict[int, Stream] = {}

    def call(cid: int, name: str, args: tuple) -> None:
        try:
            value, error = getattr(backend, name)(*args), None
        except Exception as e:  # noqa: BLE001 - raised again in the console
            value, error = None, portable(e)
        try:
            send(("reply", cid, value, error))
        except Exception as e:  # noqa: BLE001 - a value that does not pickle
            send(("reply", cid, None, portable(e)))

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            log.info("the console is gone: the engine process ends")
            os._exit(0)  # a stream's pass may still run: nothing of it is wanted
        except Exception:  # noqa: BLE001 - a message that does not unpickle here: refused, the others go on
            log.exception("a message from the console could not be read")
            continue
        what = message[0]
        if what == "stop":
            break
        if what == "stream":
            sid, kind, request, engine_name = message[1:]
            # open_run(cancel, clock): the backend's stream of this request
            open_run = (partial(backend.baseline, request) if kind == "baseline"
                        else partial(backend.speculative, request, engine=engine_name))
            streams[sid] = Stream(sid, open_run, send)
        elif what in ("next", "close", "cancel"):
            stream = streams.get(message[1])
            if stream is None:
                continue
            if what == "cancel":
                stream.cancel.set()
            elif what == "next":
                engine.submit(stream.advance)
            else:
                engine.submit(streams.pop(message[1]).close)
        elif what == "call":
            cid, name, args = message[1:]
            if name in ENGINE_CALLS:
                engine.submit(call, cid, name, args)
            elif name in CALLS:  # answered at once, also while a pass runs
                threading.Thread(target=call, args=(cid, name, args), daemon=True, name="engine-call").start()
            else:
                send(("reply", cid, None, AttributeError(f"the engine process serves no call {name!r}")))
        for sid in [sid for sid, s in streams.items() if s.done]:
            streams.pop(sid)  # ended streams (the console closes each, but one that died with it may not)
    engine.submit(backend.close).result()


def _orphaned(console: int) -> None:
    """End this process once the console is gone, also while the models load (when nothing reads the pipe)."""
    while os.getppid() == console:
        time.sleep(0.5)
    os._exit(0)


def main(fd: int) -> None:
    """`python -m engine.process.child FD`: FD is this process's end of the console's socket pair. The console sends
    its sys.path first (the factory may live in a module only its path finds), then the factory."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine[%(process)d] %(name)s: "
                                                   "%(message)s")
    conn = Connection(fd)
    threading.Thread(target=_orphaned, args=(os.getppid(),), daemon=True, name="engine-orphaned").start()
    try:
        sys.path[:] = conn.recv()
        factory = conn.recv()
    except (EOFError, OSError):
        return  # the console went away before it said what to build
    serve(conn, factory)


if __name__ == "__main__":
    main(int(sys.argv[1]))
