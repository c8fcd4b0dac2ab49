"""What a backend of HTTP servers is, whatever the server: one server process per engine (baseline, speculative,
speculative-2 ...), started one after the other and stopped together, warmed up before the first run, and the
speculative one restarted with other drafting settings, with the old ones running again if the new ones fail.
engine.vllm.backend.VLLMBackend and engine.llamacpp.backend.LlamaCppBackend extend ServerBackend with what their
servers speak: the request's body, the streamed chunks, the token kinds.

A server drafts by its own settings, so the request's drafting settings do not apply (ignored_settings) and there
is no cost model of ours to calibrate."""

from __future__ import annotations

import logging
import threading
import time
from functools import cached_property
from typing import Callable, Iterator, Protocol, Sequence

import httpx

from engine.drafting import DRAFTING_SETTINGS
from engine.events import Event, RunResult
from engine.limits import SettingsError
from engine.request import Request
from engine.serving.counters import parse_counters, server_counters
from engine.serving.http_safety import ResponseRefused, endpoint, fetch, redact
from engine.serving.stream import ServerError

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0  # a /metrics page is small and the server answers it between steps


class Server(Protocol):
    """A managed server process (engine.serving.guarded_process.GuardedProcess): its URL once started."""

    url: str | None

    def start(self) -> None: ...

    def stop(self) -> None: ...


def start_in_turn(servers: Sequence[Server], on_progress: Callable | None = None,
                  describe: Callable[[Server], str] = lambda s: "a server") -> list[Server]:
    """Start `servers` one after the other, each load having the machine (and its memory) to itself. If one fails,
    those already started are stopped before the error goes on: no server outlives a failed start."""
    started: list[Server] = []
    try:
        for i, server in enumerate(servers):
            if on_progress:
                on_progress(f"starting {describe(server)}", i, len(servers))
            started.append(server)
            server.start()
    except BaseException:
        for server in started:
            server.stop()
        raise
    return started


class ServerBackend:
    """engine.backend.Backend's server-side half: the lifecycle and the answers every server backend gives alike.
    A subclass sets `name`, `error` (its ServerError), `urls` (engine -> URL), `headers` (sent with every request),
    `servers` (the managed processes, baseline first; empty when attached) and `counter_prefix` (its /metrics
    counters' prefix), and implements `_stream(engine, req, cancel, clock)` and `warm_up()`."""

    name = "server"
    error: type[ServerError] = ServerError
    urls: dict[str, str]
    headers: dict
    servers: list
    counter_prefix = ""  # e.g. "vllm:spec_decode_"
    counters_hint = ""  # where a server has none: how to start it with them

    # --- lifecycle -------------------------------------------------------------------------------------------------

    def warm_up(self) -> None:
        raise NotImplementedError

    def warmed_up(self):
        """This backend after its warm-up; a backend whose servers cannot answer is closed before the error goes on
        (servers must not outlive a failed start)."""
        try:
            self.warm_up()
        except BaseException:
            self.close()
            raise
        return self

    def managed_speculative(self) -> Server:
        """The speculative server the console started (servers[1]); `error` where the servers were attached."""
        if len(self.servers) < 2:
            raise self.error(f"only {self.name} servers the console started can be reconfigured; restart yours by "
                             "hand")
        return self.servers[1]

    def restart_speculative(self, new: Server, old_again: Callable[[], Server],
                            started: Callable[[], None] = lambda: None) -> None:
        """Replace the managed speculative server with `new`, then call `started` (a warm-up). If `new` does not
        start, a fresh copy of the old one (`old_again()`) runs again and the error is raised."""
        self.managed_speculative().stop()
        try:
            new.start()
        except ServerError as e:
            old = old_again()
            old.start()  # if the old settings fail too, that error is the one to see
            self._serve_speculative(old, started)
            raise self.error(f"the new drafting settings failed; the previous ones are running again. {e}") from e
        self._serve_speculative(new, started)

    def _serve_speculative(self, server: Server, started: Callable[[], None]) -> None:
        self.servers[1], self.urls["speculative"] = server, server.url
        self._without_counters.discard("speculative")  # a managed server is started with its counters on
        started()

    def close(self) -> None:
        for server in self.servers:
            server.stop()

    # --- what every server backend answers alike -------------------------------------------------------------------

    def calibration(self) -> dict:
        return {}  # the server's own policy drafts: it has no cost model of ours

    def recalibrate(self) -> dict:
        raise SettingsError(f"the {self.name} server drafts by its own settings: there is no cost model to measure")

    def ignored_settings(self, req: Request) -> tuple[str, ...]:
        # each speculative server drafts as it was started (reconfigure() changes that)
        return DRAFTING_SETTINGS + req.drafting.server_settings_set()

    # --- runs ------------------------------------------------------------------------------------------------------

    def baseline(self, req: Request, cancel: threading.Event | None = None, clock=time.perf_counter
                 ) -> Iterator[Event]:
        yield from self._stream("baseline", req, cancel, clock)

    def speculative(self, req: Request, cancel: threading.Event | None = None, clock=time.perf_counter,
                    engine: str = "speculative") -> Iterator[Event]:
        if engine == "baseline" or engine not in self.urls:
            raise self.error(f"no {engine} engine on this {self.name} backend; it has {', '.join(self.urls)}")
        yield from self._stream(engine, req, cancel, clock)

    def _stream(self, engine: str, req: Request, cancel, clock) -> Iterator[Event]:
        raise NotImplementedError

    # --- the server's own counters ----------------------------------------------------------------------------------

    def scrape(self, engine: str) -> dict | None:
        """`engine`'s server's spec-decode counters (engine.serving.counters.parse_counters), or None (unknown, with
        a log warning) where its /metrics cannot be read; never an error of the run's. A server without the page
        (llama-server started without --metrics answers 501) or without the counters is said once and not asked
        again."""
        if engine in self._without_counters:
            return None
        try:
            resp = fetch("GET", endpoint(self.urls[engine], "/metrics"), headers=self.headers,
                         timeout=SCRAPE_TIMEOUT_S)
        except (httpx.HTTPError, httpx.InvalidURL, ResponseRefused, ServerError) as e:
            log.warning("the %s server's /metrics could not be read (%s: %s): its counters are unknown for this "
                        "run", engine, type(e).__name__, redact(str(e))[:200])
            return None
        if resp.status_code in (404, 501) or resp.status_code == 200 and self.counter_prefix not in resp.text:
            self._without_counters.add(engine)
            why = (f"answered {resp.status_code}" if resp.status_code != 200
                   else f"has no {self.counter_prefix}* counters")
            log.warning("the %s server's /metrics %s: its counters are unknown%s", engine, why, self.counters_hint)
            return None
        if resp.status_code != 200:
            log.warning("the %s server's /metrics answered %d: its counters are unknown for this run", engine,
                        resp.status_code)
            return None
        return parse_counters(resp.text, self.counter_prefix)

    def counted(self, engine: str, before: dict | None, result: RunResult, cut: int = 0) -> None:
        """The server's count of the run (its counters read now, and `before` it) into result.metrics.server_counters,
        beside the run's drafted / accepted (engine.serving.counters.server_counters: `cut` and the expected
        differences). Not read where `before` is unknown, or the run failed (its server may not answer)."""
        if before is None or result.error:
            return
        m = result.metrics
        m.server_counters = server_counters(before, self.scrape(engine), m.drafted, m.accepted, cut=cut,
                                            shared=not self.servers, stopped=result.finish_reason == "cancelled")

    @cached_property
    def _without_counters(self) -> set[str]:
        """The engines whose server has no counters to read (said once)."""
        return set()
