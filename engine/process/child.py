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
between two passes are not the engine's time. Each stream has a thread of its own, so that two engines can also run
at once (race mode), as they would in one process.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import sys
import threading
import time
from functools import partial
from multiprocessing.connection import Connection
from typing import Callable

from engine.clock import EngineClock
from engine.events import RunResult, StepRecord

log = logging.getLogger(__name__)

# the Backend methods the console may call over the pipe; streams are opened with "stream"
CALLS = ("validate", "ignored_settings", "score", "describe", "memory", "drafting", "reconfigure", "variants",
         "why_float32", "calibration", "recalibrate")


def portable(error: BaseException) -> BaseException:
    """`error` if it crosses the pipe intact, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any exception that does not pickle
        return RuntimeError(f"{type(error).__name__}: {error}")


class Stream(threading.Thread):
    """One engine's run in this process, advanced one pass per "next"."""

    def __init__(self, sid: int, open_run: Callable, send: Callable):
        super().__init__(daemon=True, name=f"engine-stream-{sid}")
        self.sid, self.open_run, self.send = sid, open_run, send
        self.commands: queue.Queue = queue.Queue()
        self.cancel = threading.Event()
        self.clock = EngineClock()

    def run(self) -> None:
        events = None
        while self.commands.get() == "next":
            batch, error, done = [], None, False
            self.clock.resume()
            try:
                if events is None:
                    events = iter(self.open_run(self.cancel, self.clock))
                for event in events:
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
            try:
                self.send(("events", self.sid, batch, error, done))
            except Exception as e:  # noqa: BLE001 - an event that does not pickle: the run ends, and says why
                self.send(("events", self.sid, [], portable(e), True))
                return
            if done:
                return
        if events is not None and hasattr(events, "close"):
            events.close()


def serve(conn, factory: Callable) -> None:
    """Build the backend with `factory(on_progress)`, then serve `conn` until "stop" or until the console is gone
    (the pipe's end-of-file: however the console ended, SIGKILL included)."""
    from engine.setup import setup

    setup()
    lock = threading.Lock()

    def send(message) -> None:
        """One message to the console; pickled first, so that one that does not pickle raises here, whole."""
        data = pickle.dumps(message)
        with lock:
            conn.send_bytes(data)

    try:
        backend = factory(lambda stage, done, total: send(("progress", stage, done, total)))
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
            sid, kind, request, engine = message[1:]
            # open_run(cancel, clock): the backend's stream of this request
            open_run = (partial(backend.baseline, request) if kind == "baseline"
                        else partial(backend.speculative, request, engine=engine))
            stream = streams[sid] = Stream(sid, open_run, send)
            stream.start()
        elif what in ("next", "close", "cancel"):
            stream = streams.get(message[1])
            if stream is None:
                continue
            if what == "cancel":
                stream.cancel.set()
            else:
                stream.commands.put(what)
            if what == "close":
                streams.pop(message[1])
        elif what == "call":
            cid, name, args = message[1:]
            if name in CALLS:
                threading.Thread(target=call, args=(cid, name, args), daemon=True, name="engine-call").start()
            else:
                send(("reply", cid, None, AttributeError(f"the engine process serves no call {name!r}")))
        for sid in [sid for sid, s in streams.items() if not s.is_alive() and s.commands.empty()]:
            streams.pop(sid)  # ended streams (the console closes each, but one that died with it may not)
    backend.close()


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
