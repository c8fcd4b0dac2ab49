"""Loads the models (or starts the vLLM servers) in the background, so that the page is up at once and shows the
progress meanwhile."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class ModelHost:
    def __init__(self, label: str, factory: Callable, method: str = "draft"):
        """factory(on_progress) builds the backend; `method` is the drafting method the page starts with."""
        self.label, self.factory, self.method = label, factory, method
        self.backend = None
        self.error: str | None = None
        self.stage, self.done, self.total = "waiting to load", 0.0, 1.0
        self.started = time.monotonic()
        self.lock = threading.Lock()  # one comparison at a time: both engines share these models
        self.closed = False
        self._thread = threading.Thread(target=self._load, daemon=True, name="specconsole-loader")

    def start(self) -> "ModelHost":
        self._thread.start()
        return self

    def _progress(self, stage: str, done: float, total: float) -> None:
        self.stage, self.done, self.total = stage, done, total or 1.0

    def _load(self) -> None:
        try:
            backend = self.factory(self._progress)
            if self.closed:  # the console ended while the servers were starting: stop them now
                backend.close()
                return
            self.backend = backend
            self.stage = "ready"
            log.info("models ready after %.0f s", time.monotonic() - self.started)
        except Exception as e:  # noqa: BLE001 - shown in the page; the console stays up
            log.exception("loading the models failed")
            self.error = f"{type(e).__name__}: {e}"

    @property
    def ready(self) -> bool:
        return self.backend is not None

    def wait(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return self.ready

    def status(self) -> str:
        if self.error:
            return f"Loading failed ({self.label}): {self.error}"
        if self.ready:
            return f"Ready: {self.label}"
        pct = 100 * self.done / self.total if self.total else 0
        return f"Loading {self.label}: {self.stage} ({pct:.0f}%, {time.monotonic() - self.started:.0f} s)"

    def close(self) -> None:
        """Stop what the backend started (managed vLLM servers); safe to call more than once."""
        self.closed = True
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.close()
