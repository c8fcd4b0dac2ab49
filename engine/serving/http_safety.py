"""What a model server over HTTP can make the console read, and the credentials its URL may carry, kept bounded and
out of sight. For every HTTP backend (engine.vllm.client and engine.vllm.backend use it).

A server is trusted to answer, not to behave: a line that never ends, a body of gigabytes, tokens without end or a
figure that cannot be true must cost bounded memory and time and end in a clear error, or leave the figure
"unknown" with a log warning; never a crash, and never a value saved in the history that breaks a table later.
A URL is shown (page, report, error, log) only through redact().
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator

import httpx

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 64 * 1024  # one streamed line, beyond what the request itself explains (engine.vllm.client)
MAX_ERROR_BYTES = 4 * 1024  # of an error response's body: the server's message fits, a flood is never read
MAX_BODY_BYTES = 16 * 1024 * 1024  # of a whole response (/v1/models, /metrics, scores)


class ResponseRefused(Exception):
    """A response read no further: it, or one line of a stream, is longer than its limit, or it is compressed
    (asked for uncompressed, as IDENTITY does: a small compressed body can unpack to gigabytes)."""


IDENTITY = {"Accept-Encoding": "identity"}


# --- credentials ---------------------------------------------------------------------------------------------------

URL = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^\s'\"<>]+")
USERINFO = re.compile(r"^([^:]+://)[^/?#]*@")  # up to the last @ of the authority: a password may hold an @
QUERY_VALUE = re.compile(r"([?&][^=&#]*=)[^&#]*")  # any query value: api_key=, token=, sig=, ... alike


def redact(text: str) -> str:
    """`text` (a URL, or a message that holds URLs) with each URL's user:password@ and query values replaced by
    ***: http://user:pw@host/v1?api_key=k -> http://***@host/v1?api_key=***."""
    def one(m: re.Match) -> str:
        return QUERY_VALUE.sub(r"\1***", USERINFO.sub(r"\1***@", m.group(0)))

    return URL.sub(one, str(text))


def endpoint(base: str, path: str) -> str:
    """`path` under a server's base URL, keeping the base's query (an ?api_key=... a proxy wants on every request)."""
    url = httpx.URL(base)
    return str(url.copy_with(path=url.path.rstrip("/") + path))


class RedactURLs(logging.Filter):
    """httpx logs every request's URL at INFO; the credentials in it must not reach the console's log (engine.setup
    adds it to httpx's logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(str(a)) if isinstance(a, (str, httpx.URL)) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        return True


# --- bounded reading -------------------------------------------------------------------------------------------------

LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def _uncompressed(resp: httpx.Response) -> None:
    """ResponseRefused unless the body comes as sent: it is read raw, so that its limit counts what is kept."""
    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ResponseRefused(f"the answer is compressed ({encoding[:40]}) although it was asked for uncompressed")


def size(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n >= 1024 * 1024 else f"{n // 1024} KiB"


def iter_lines(resp: httpx.Response, max_line: int) -> Iterator[str]:
    """The lines of a streamed response (ended by \\n, \\r\\n or \\r), as text; ResponseRefused as soon as one
    grows past `max_line` bytes, so an endless line costs at most that much memory."""
    _uncompressed(resp)
    pending = b""
    for piece in resp.iter_raw():
        data = pending + piece
        held_cr = data.endswith(b"\r")  # its \n may come with the next piece: one line break, not two
        *lines, pending = LINE_BREAK.split(data[:-1] if held_cr else data)
        pending += b"\r" if held_cr else b""
        if len(pending) > max_line or any(len(line) > max_line for line in lines):
            raise ResponseRefused(f"a streamed line is longer than {size(max_line)}: cut off there")
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if pending.rstrip(b"\r"):
        yield pending.rstrip(b"\r").decode("utf-8", errors="replace")


def read_capped(resp: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """At most `limit` bytes of a streamed response's body, and whether there was more (never read)."""
    _uncompressed(resp)
    body = bytearray()
    for piece in resp.iter_raw():
        body += piece
        if len(body) > limit:
            return bytes(body[:limit]), True
    return bytes(body), False


async def aread_capped(resp: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """read_capped for an httpx.AsyncClient's streamed response."""
    _uncompressed(resp)
    body = bytearray()
    async for piece in resp.aiter_raw():
        body += piece
        if len(body) > limit:
            return bytes(body[:limit]), True
    return bytes(body), False


def error_text(body: bytes, more: bool) -> str:
    """An error body (read with MAX_ERROR_BYTES) as one line of text for a message."""
    text = redact(" ".join(body.decode("utf-8", errors="replace").split()))
    return text + (f" ... (cut at {size(MAX_ERROR_BYTES)})" if more else "")


def _answer(resp: httpx.Response, body: bytes, more: bool, limit: int) -> httpx.Response:
    if resp.status_code < 400 and more:
        raise ResponseRefused(f"the answer is larger than {size(limit)}: not read")
    if resp.status_code >= 400:
        body = error_text(body, more).encode()
    return httpx.Response(resp.status_code, content=body, request=resp.request)


def fetch(method: str, url: str, limit: int = MAX_BODY_BYTES, **kwargs) -> httpx.Response:
    """httpx.request with the body read up to `limit` bytes (ResponseRefused beyond), and at most MAX_ERROR_BYTES
    of an error's (4xx, 5xx: the rest is dropped; its .text is a redacted one-line summary)."""
    kwargs["headers"] = {**(kwargs.get("headers") or {}), **IDENTITY}
    with httpx.stream(method, url, **kwargs) as resp:
        body, more = read_capped(resp, MAX_ERROR_BYTES if resp.status_code >= 400 else limit)
    return _answer(resp, body, more, limit)


async def afetch(client: httpx.AsyncClient, method: str, url: str, limit: int = MAX_BODY_BYTES,
                 **kwargs) -> httpx.Response:
    """fetch() on an httpx.AsyncClient."""
    kwargs["headers"] = {**(kwargs.get("headers") or {}), **IDENTITY}
    async with client.stream(method, url, **kwargs) as resp:
        body, more = await aread_capped(resp, MAX_ERROR_BYTES if resp.status_code >= 400 else limit)
    return _answer(resp, body, more, limit)


# --- figures a server reports ----------------------------------------------------------------------------------------


def number(value, what: str, low: float = 0.0, high: float = 1e15, integer: bool = False,
           warned: set | None = None) -> float | int | None:
    """`value` when it is a finite number within [low, high] (a whole one where `integer`), else None: a figure
    that is not a number or cannot be true is unknown. Logs a warning, once per `what` for a given `warned` set
    (one per stream: a bad field on every token warns once)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        ok = False
    elif isinstance(value, int):  # exact: a huge int never goes through float
        ok = low <= value <= high
    else:
        ok = math.isfinite(value) and low <= value <= high and (not integer or value.is_integer())
    if ok:
        return int(value) if integer else value
    if value is not None and (warned is None or what not in warned):
        if warned is not None:
            warned.add(what)
        log.warning("the server sent %s = %.80r, not a %s from %s to %s: shown as unknown", what, value,
                    "whole number" if integer else "number", low, high)
    return None
