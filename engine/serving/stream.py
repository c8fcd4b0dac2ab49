"""One streamed request to a model server: the `data:` lines of its server-sent events, each parsed into a Chunk
(token ids, text, per-token probability and near-tie evidence, usage) by the server's own parser, under a stall
timeout, cancel and the stream's limits (engine.serving.http_safety). vLLM's parser is engine.vllm.client, llama.cpp's
engine.llamacpp.client.

ServerError is what every server backend raises for a server that cannot be started, reached or trusted; the
console and the workbench catch it whichever backend it comes from.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

import httpx

from engine.serving.http_safety import (IDENTITY, MAX_ERROR_BYTES, MAX_LINE_BYTES, ResponseRefused, error_text,
                                        iter_lines, read_capped)

CONNECT_TIMEOUT_S = 10.0
TOKEN_MARGIN = 16  # tokens a stream may bring beyond max_tokens before it is cut off (servers never send more)
# a token in a chunk: its id, text and logprob entry, with a greedy run's top 2 (vLLM); a chunk may hold many
LINE_BYTES_PER_TOKEN = 512


class ServerError(RuntimeError):
    """A server that cannot be started, reached or trusted; the message says why (with its log's tail)."""


class StreamError(ServerError):
    """The server answered, but its stream broke off or carried something that cannot be read."""


class Cancelled(Exception):
    """The caller's cancel event was set; the stream was closed, which aborts the request on the server."""


@dataclass
class StreamedToken:
    token_id: int
    text: str  # the token's own text where the server gives it (logprobs), else "" (or the chunk's text: see below)
    p: float | None  # the target's probability of the token, from its logprob
    # a greedy run's near-tie evidence where the server sends its top 2 (engine.events.TokenEvent): the best other
    # token's text and how far this token's logit was above it; None where not sent or not readable
    runner_up_text: str | None = None
    margin: float | None = None


@dataclass
class Chunk:
    """One `data:` line, all choices together (the console asks for one)."""

    tokens: list[StreamedToken] = field(default_factory=list)
    text: str = ""  # the text the chunk adds, as the server detokenized it (special tokens skipped)
    finish_reason: str | None = None  # "length" | "eos" | "stop" on the chunk that ends the answer
    prompt_ids: list[int] | None = None  # the first chunk brings them
    usage: dict | None = None  # the final chunk's usage: {"prompt_tokens", "completion_tokens", ...}
    metrics: dict | None = None  # the per-request metrics next to it (time_to_first_token_ms, ...,
    # speculative_decoding: {num_spec_steps, num_draft_tokens, num_accepted_draft_tokens, per_step_accepted, ...})


def line_limit(body: dict) -> int:
    """The longest `data:` line a request can get: the first chunk lists the prompt's token ids (at most one per
    byte of the request, ~10 bytes each), a chunk of merged steps holds its tokens with their logprobs, the final
    one the per-step counts; MAX_LINE_BYTES above that."""
    return MAX_LINE_BYTES + 12 * len(json.dumps(body)) + LINE_BYTES_PER_TOKEN * body["max_tokens"]


def stream_chunks(url: str, body: dict, headers: dict, stall_timeout: float, cancel: threading.Event | None,
                  parse: Callable[[str, set], Chunk], last: Callable[[Chunk], bool] | None = None) -> Iterator[Chunk]:
    """POST `body` to `url` and yield its chunks until `data: [DONE]`. Raises StreamError (a bad status, a chunk
    that cannot be read, a stream without [DONE], one past its limits), httpx.TimeoutException (no byte for
    `stall_timeout` seconds), another httpx.HTTPError (connection lost) or Cancelled. `parse`: the server's chunk
    parser; `last`: the chunk that ends its stream where it sends no [DONE] (engine.llamacpp.client)."""
    timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=stall_timeout)
    max_tokens = body["max_tokens"] + TOKEN_MARGIN
    max_lines = 8 * max_tokens + 64  # a data line and a blank one per chunk, and room for comments
    tokens, lines, warned = 0, 0, set()
    try:
        with httpx.stream("POST", url, json=body, headers={**headers, **IDENTITY}, timeout=timeout) as resp:
            if resp.status_code != 200:
                raise StreamError(f"answered {resp.status_code}: {error_text(*read_capped(resp, MAX_ERROR_BYTES))}")
            for line in iter_lines(resp, line_limit(body)):
                if cancel is not None and cancel.is_set():
                    raise Cancelled()  # leaving the `with` closes the stream
                lines += 1
                if lines > max_lines:
                    raise StreamError(f"the stream went on past {max_lines} lines for {body['max_tokens']} tokens "
                                      "without ending: cut off")
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": ping"), other SSE fields
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                chunk = parse(payload, warned)
                tokens += len(chunk.tokens)
                if tokens > max_tokens:
                    raise StreamError(f"the server streamed more tokens than asked for ({body['max_tokens']}, "
                                      f"cut off at {max_tokens})")
                yield chunk
                if last is not None and last(chunk):
                    return
    except ResponseRefused as e:
        raise StreamError(str(e)) from None
    raise StreamError("the stream ended before its last line (data: [DONE]): the server closed the connection "
                      "mid-answer")


