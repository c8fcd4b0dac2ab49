"""The Run tab's queue: one comparison at a time on the engines, across browser tabs, and Stop for each session.

Two comparisons at once would share the CPU and both runs' timings would be wrong, so a second Run waits here for the
first (saying so in its panels), at most MAX_QUEUED_RUNS of them; Stop cancels a session's running comparison or
its place in the queue."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from html import escape

from engine.backend import ENGINES
from engine.limits import MAX_QUEUED_RUNS
from specconsole.render import PanelFeed, panel_notice
from specconsole.run_stream import notices, outputs_of
from specconsole.runner import Comparison

QUEUED = ("Queued behind another run: runs go one at a time, because the timings of concurrent runs would share "
          "the CPU. This one starts when that one ends (Stop cancels it).")
TOO_MANY_QUEUED = (f"{MAX_QUEUED_RUNS} runs are already waiting for the engines (the most that may wait): press Run "
                   "again when one of them has started, or Stop one.")


class RunQueue:
    def __init__(self, lock: threading.Lock):
        self.lock = lock  # the model host's: also taken by a restart of a server and a new calibration
        self.waiting: dict[str, threading.Event] = {}  # session -> set by Stop while its run waits
        self.running: dict[str, Comparison] = {}  # session -> its comparison, for Stop

    def take_turn(self, session: str, panel_run: str, engines: list[str]) -> Generator[tuple, None, bool]:
        """Wait for the engines, yielding the page's updates meanwhile. Returns True holding the lock (enter run()
        at once: it gives the lock back), or False: refused (too many waiting) or stopped before it started, the
        panels saying which."""
        if self.lock.acquire(blocking=False):
            return True
        if len(self.waiting) >= MAX_QUEUED_RUNS and session not in self.waiting:
            yield outputs_of(notices(ENGINES, panel_notice(panel_run, TOO_MANY_QUEUED)), "")
            return False
        stopped = self.waiting[session] = threading.Event()
        try:  # a tab closed at any yield below leaves the queue
            yield outputs_of(notices(engines, PanelFeed(panel_run).message([], QUEUED)),
                             f'<div class="status-line">{escape(QUEUED)}</div>')
            while not self.lock.acquire(timeout=1.0):
                if stopped.is_set():
                    yield outputs_of(notices(engines, PanelFeed(panel_run).message([], "Stopped before it started.")),
                                     "")
                    return False
                yield outputs_of()  # gives gradio the chance to drop the run of a page that was closed
            return True
        finally:
            self.waiting.pop(session, None)

    @contextmanager
    def run(self, session: str, start: Callable[[], Comparison]) -> Iterator[Comparison]:
        """The comparison `start()` builds, run for `session` once its turn is taken; a closed tab or an error must
        not leave the engines running, and the next run in the queue starts once this one ends."""
        try:
            comp = self.running[session] = start()
            try:
                yield comp
            finally:
                comp.cancel.set()
                self.running.pop(session, None)
        finally:
            self.lock.release()

    def stop(self, session: str) -> None:
        comp = self.running.get(session)
        if comp:
            comp.cancel.set()
        if session in self.waiting:
            self.waiting[session].set()
