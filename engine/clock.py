"""A clock that runs only while an engine computes: fair mode's turns and the engine process's streams time with it."""

from __future__ import annotations

import time


class EngineClock:
    """Seconds an engine has spent computing: it runs only between resume() and pause()."""

    def __init__(self):
        self.elapsed, self.since = 0.0, None

    def resume(self) -> None:
        self.since = time.perf_counter()

    def pause(self) -> None:
        if self.since is not None:  # (a turn that failed before its clock started)
            self.elapsed += time.perf_counter() - self.since
            self.since = None

    def __call__(self) -> float:
        return self.elapsed + (time.perf_counter() - self.since if self.since is not None else 0.0)
