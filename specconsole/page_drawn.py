"""The browser's word that it has drawn an update, so that the next timed pass starts only after the drawing.

The browser runs on the engines' cores: whatever it draws while a pass is timed slows that pass. In fair mode the
Run tab marks each update's first changed live panel with `ack` (a number); assets/live_panel.js applies the
message and, after the next paint, sends the word "<panel run>:<ack>" as a beacon to POST /page_drawn
(`DrawnBeacon`, a middleware: a beacon's answer leaves the browser nothing to do, where a Gradio server function's
reply arrived just as the next pass started). The Run tab waits for that word (up to ACK_WAIT_S) before it lets the
next turn start. A page that does not answer in time (a hidden tab, which does not paint, or an API client, which
has no page) is not waited for again in that run: a short settle (SETTLE_S) stands in for the word.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

ACK_WAIT_S = 2.0  # a loaded 2-core machine can take over a second (idle callbacks wait up to 0.5 s, twice)
SETTLE_S = 0.05


@dataclass
class RunAcks:
    """One run's updates that wait for the page's word, and how many it answered or missed."""
    run: str
    expected: int = 0  # the ack number of the update the page has not answered yet (0: none)
    answered: int = 0
    missed: int = 0
    drawn: threading.Event = field(default_factory=threading.Event)

    @property
    def trusted(self) -> bool:
        return self.missed == 0  # once the page missed a word, this run does not wait for it again


class PageAcks:
    """The runs of this console whose page may answer; `page_drawn` is what the browser calls."""

    def __init__(self):
        self._lock = threading.Lock()
        self._runs: dict[str, RunAcks] = {}
        self.answered = self.missed = 0  # over all runs, for the log and the tests

    def open(self, run: str) -> RunAcks:
        with self._lock:
            acks = self._runs[run] = RunAcks(run)
        return acks

    def close(self, run: str) -> None:
        with self._lock:
            self._runs.pop(run, None)

    def expect(self, acks: RunAcks) -> int:
        """The number the next update carries."""
        with self._lock:
            acks.drawn.clear()
            acks.expected = acks.answered + acks.missed + 1
            return acks.expected

    def wait(self, acks: RunAcks) -> bool:
        """Wait for the page to draw the expected update; False (and no more waiting this run) when it did not."""
        if acks.drawn.wait(ACK_WAIT_S):
            return True
        with self._lock:
            acks.missed += 1
            self.missed += 1
            acks.expected = 0
        log.info("run %s: the page did not say it drew an update within %.1f s; not waiting for it again",
                 acks.run, ACK_WAIT_S)
        return False

    def page_drawn(self, word) -> None:
        """`word` is "<panel run>:<ack>" from the page; anything else is ignored (the page is not trusted input)."""
        run, _, number = str(word)[:64].partition(":")
        with self._lock:
            acks = self._runs.get(run)
            if acks is None or not number.isdigit() or int(number) != acks.expected:
                return
            acks.expected = 0
            acks.answered += 1
            self.answered += 1
            acks.drawn.set()


ACKS = PageAcks()  # one per console process: runs are told apart by their panel run ids


class DrawnBeacon:
    """ASGI middleware: POST /page_drawn, whose body is the word (at most 64 bytes are read), tells ACKS and
    answers 204 at once."""

    PATH = "/page_drawn"

    def __init__(self, app, acks: PageAcks | None = None):
        self.app, self.acks = app, acks or ACKS

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.PATH:
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more and len(body) <= 64:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.acks.page_drawn(body[:64].decode("utf-8", "replace"))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
