"""One streamed request to a vLLM OpenAI-compatible server: the request body for a Request, the `data:` lines of
the server-sent events, each parsed into a Chunk (token ids, text, per-token probability, usage), a stall timeout
and cancel.

Anything the server sends that does not have the expected shape, and a stream that ends before `data: [DONE]`,
raises StreamError saying what was wrong: the caller keeps the tokens it had and reports the error; nothing is
guessed. So does a stream past its limits (engine.serving.http_safety): a line longer than the request can explain, more
tokens than max_tokens allows, an error body (only its first 4 KiB are read). A token's logprob that is not a
possible one leaves its probability unknown. The client knows nothing of token kinds or steps (engine.vllm.backend
does).
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

import httpx

from engine.serving.http_safety import (IDENTITY, MAX_ERROR_BYTES, MAX_LINE_BYTES, ResponseRefused, error_text, iter_lines,
                                number, read_capped)
from engine.prompts import chat_messages
from engine.request import Request
from engine.vllm.server import VLLMError

CONNECT_TIMEOUT_S = 10.0
TOKEN_MARGIN = 16  # tokens a stream may bring beyond max_tokens before it is cut off (vLLM never sends more)
LINE_BYTES_PER_TOKEN = 256  # a token in a chunk: its id, text and logprob entry; a chunk may hold many
LOGPROB_SLACK = 1e-3  # a logprob a little above 0 is rounding; more is not a probability


class StreamError(VLLMError):
    """The server answered, but its stream broke off or carried something that cannot be read."""


class Cancelled(Exception):
    """The caller's cancel event was set; the stream was closed, which aborts the request on the server."""


@dataclass
class StreamedToken:
    token_id: int
    text: str  # the token's own text where the server gives it (logprobs), else "" (or the chunk's text: see below)
    p: float | None  # the target's probability of the token, from its logprob


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


def request_body(req: Request, model: str) -> tuple[str, dict]:
    """(path, JSON body) of the streamed request for `req`: chat or plain completion, with token ids, per-token
    logprobs (for the text and p) and the final usage chunk."""
    s = req.sampling
    body = {"model": model, "max_tokens": req.max_new_tokens, "temperature": s.temperature,
            "top_p": s.top_p, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "logprobs": True}
    if s.top_k:
        body["top_k"] = s.top_k
    if s.seed is not None:
        body["seed"] = s.seed
    if req.stop_strings:
        body["stop"] = list(req.stop_strings)
    if req.chat:
        return "/v1/chat/completions", body | {"messages": chat_messages(req.prompt, req.earlier_turns),
                                               "top_logprobs": 0}
    return "/v1/completions", body | {"prompt": req.prompt, "logprobs": 0}


def line_limit(body: dict) -> int:
    """The longest `data:` line a request can get: the first chunk lists the prompt's token ids (at most one per
    byte of the request, ~10 bytes each), a chunk of merged steps holds its tokens with their logprobs, the final
    one the per-step counts; MAX_LINE_BYTES above that."""
    return MAX_LINE_BYTES + 12 * len(json.dumps(body)) + LINE_BYTES_PER_TOKEN * body["max_tokens"]


def stream_chunks(url: str, body: dict, headers: dict, stall_timeout: float,
                  cancel: threading.Event | None = None, parse: Callable[[str, set], Chunk] | None = None,
                  last: Callable[[Chunk], bool] | None = None) -> Iterator[Chunk]:
    """POST `body` to `url` and yield its chunks until `data: [DONE]`. Raises StreamError (a bad status, a chunk
    that cannot be read, a stream without [DONE], one past its limits), httpx.TimeoutException (no byte for
    `stall_timeout` seconds), another httpx.HTTPError (connection lost) or Cancelled. `parse` and `last`: another
    server's chunks and the chunk that ends its stream instead of [DONE] (engine.llamacpp.client)."""
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
                chunk = (parse or parse_chunk)(payload, warned)
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


def parse_chunk(payload: str, warned: set | None = None) -> Chunk:
    """A `data:` line's JSON as a Chunk; StreamError if it is not JSON, is an error report, or lacks what every
    chunk has. `warned`: the figures already logged as unreadable in this stream (each is logged once)."""
    try:
        data = json.loads(payload)
    except ValueError as e:
        raise StreamError(f"a stream chunk is not JSON ({e}): {payload[:200]!r}") from e
    if isinstance(data, dict) and (data.get("error") or data.get("object") == "error"):
        error = data.get("error") if isinstance(data.get("error"), dict) else data
        raise StreamError(f"the server reported an error mid-answer: {error.get('message', error)}")
    try:
        return _chunk(data, warned)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise StreamError(f"a stream chunk has an unexpected shape ({type(e).__name__}: {e}): {payload[:200]!r}"
                          ) from e


def _chunk(data: dict, warned: set | None) -> Chunk:
    if not isinstance(data, dict) or not isinstance(data["choices"], list):
        raise TypeError("expected an object with a list of choices")
    usage = data.get("usage") or None
    metrics = data.get("metrics") or None if usage else None  # vLLM puts them next to the final chunk's usage
    if not isinstance(usage, (dict, type(None))) or not isinstance(metrics, (dict, type(None))):
        raise TypeError("usage and metrics must be objects")
    chunk = Chunk(prompt_ids=_ids(data.get("prompt_token_ids")) or None, usage=usage, metrics=metrics)
    for choice in data["choices"]:
        text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if text and "token_ids" not in choice:
            raise KeyError("token_ids (text without token ids: a server that ignores return_token_ids)")
        chunk.tokens += _tokens(choice, text, warned)
        chunk.text += text
        chunk.prompt_ids = chunk.prompt_ids or _ids(choice.get("prompt_token_ids")) or None
        if choice.get("finish_reason"):
            chunk.finish_reason = _finish_reason(choice)
    return chunk


def _tokens(choice: dict, text: str, warned: set | None) -> list[StreamedToken]:
    ids = _ids(choice.get("token_ids"))
    logprobs = choice.get("logprobs") or {}
    # chat: {"content": [{"token", "logprob"}, ...]}; completions: {"tokens": [...], "token_logprobs": [...]}
    pieces = logprobs.get("content") or [{"token": t, "logprob": lp} for t, lp in
                                         zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [])]
    out = []
    for i, token_id in enumerate(ids):
        piece = pieces[i] if i < len(pieces) else {}
        # each token's own text when the server gives it; else the chunk's text goes with its last token
        token_text = piece.get("token") if pieces else (text if i == len(ids) - 1 else "")
        if not isinstance(token_text, (str, type(None))):
            raise TypeError(f"a token's text must be a string, got {str(token_text)[:80]}")
        logprob = number(piece.get("logprob"), "a token's logprob", -math.inf, LOGPROB_SLACK, warned=warned)
        p = None if logprob is None else min(1.0, math.exp(logprob))
        out.append(StreamedToken(token_id, token_text or "", p))
    return out


def _ids(value) -> list[int]:
    ids = value or []
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < 2 ** 31 for t in ids):
        raise TypeError(f"token ids must be a list of integers from 0 to 2^31-1, got {str(value)[:80]}")
    return ids


def _finish_reason(choice: dict) -> str:
    """vLLM says "stop" for both EOS and a stop string; stop_reason holds the string when there was one."""
    if choice["finish_reason"] == "length":
        return "length"
    return "stop" if isinstance(choice.get("stop_reason"), str) else "eos"
