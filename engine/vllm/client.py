"""One streamed request to a vLLM OpenAI-compatible server: the request body for a Request, and each `data:` line of
its server-sent events parsed into a Chunk (token ids, text, per-token probability, usage); the stream itself is read
by engine.serving.stream.stream_chunks (stall timeout, cancel, limits).

Anything the server sends that does not have the expected shape, and a stream that ends before `data: [DONE]`,
raises StreamError saying what was wrong: the caller keeps the tokens it had and reports the error; nothing is
guessed. So does a stream past its limits (engine.serving.http_safety): a line longer than the request can explain, more
tokens than max_tokens allows, an error body (only its first 4 KiB are read). A token's logprob that is not a
possible one leaves its probability unknown; top-2 logprobs that cannot be read leave its near-tie evidence unknown.
The client knows nothing of token kinds or steps (engine.vllm.backend does).
"""

from __future__ import annotations

import json
import logging
import math

from engine.prompts import chat_messages
from engine.request import Request
from engine.serving.http_safety import number
from engine.serving.stream import Chunk, StreamedToken, StreamError

log = logging.getLogger(__name__)

LOGPROB_SLACK = 1e-3  # a logprob a little above 0 is rounding; more is not a probability


def request_body(req: Request, model: str) -> tuple[str, dict]:
    """(path, JSON body) of the streamed request for `req`: chat or plain completion, with token ids, per-token
    logprobs (for the text and p; greedy: the top 2 too, for the near-tie evidence) and the final usage chunk."""
    s = req.sampling
    # greedy: the top 2, the chosen token and its runner-up (vLLM counts the chosen one among them, so 1 would give it
    # alone), for the near-tie evidence; a sampled run has no near-tie to explain
    top = 2 if s.greedy else 0
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
                                               "top_logprobs": top}
    return "/v1/completions", body | {"prompt": req.prompt, "logprobs": top}


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
    # chat: {"content": [{"token", "logprob", "top_logprobs": [{"token", "logprob"}, ...]}, ...]}; completions:
    # {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob, ...}, ...]}, read as chat's
    tops = logprobs.get("top_logprobs") if isinstance(logprobs.get("top_logprobs"), list) else []
    pieces = logprobs.get("content") or [
        {"token": t, "logprob": lp, "top_logprobs": _entries(tops[i] if i < len(tops) else None)}
        for i, (t, lp) in enumerate(zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []))]
    out = []
    for i, token_id in enumerate(ids):
        piece = pieces[i] if i < len(pieces) else {}
        # each token's own text when the server gives it; else the chunk's text goes with its last token
        token_text = piece.get("token") if pieces else (text if i == len(ids) - 1 else "")
        if not isinstance(token_text, (str, type(None))):
            raise TypeError(f"a token's text must be a string, got {str(token_text)[:80]}")
        logprob = number(piece.get("logprob"), "a token's logprob", -math.inf, LOGPROB_SLACK, warned=warned)
        p = None if logprob is None else min(1.0, math.exp(logprob))
        out.append(StreamedToken(token_id, token_text or "", p, *_runner_up(piece, logprob, warned)))
    return out


def _entries(top):
    """A completion's top logprobs {token: logprob} as chat's [{"token", "logprob"}]; anything else as it is."""
    return [{"token": t, "logprob": lp} for t, lp in top.items()] if isinstance(top, dict) else top


def _runner_up(piece: dict, logprob: float | None, warned: set | None) -> tuple[str | None, float | None]:
    """(text, margin) of a token's runner-up from its top logprobs: the best entry other than the token itself (the
    entry with its text and logprob), and logprob(token) - logprob(runner-up). That is the logit margin our engine
    records (engine.exact.sampling.runners_up): log-softmax subtracts one constant from every logit, so differences
    of logprobs are differences of logits. (None, None) where it cannot be read off: no second entry (a sampled
    run; a completion whose top tokens share a text, which its dict merges), an entry that is not a text and a
    logprob, the token not among them, or the token below the runner-up (logprobs of another distribution than
    the one the choice was made from: vLLM's are raw, before penalties)."""
    top = piece.get("top_logprobs")
    if logprob is None or not top:
        return None, None
    entries = [(e.get("token"), number(e.get("logprob"), "a top logprob", -math.inf, LOGPROB_SLACK, warned=warned))
               if isinstance(e, dict) else (None, None) for e in (top if isinstance(top, list) else [top])]
    if not all(isinstance(text, str) for text, _ in entries):
        if warned is None or "top logprobs" not in warned:
            log.warning("the server sent top logprobs that are not texts with logprobs (%.120r): the near-tie "
                        "evidence is unknown", top)
        if warned is not None:
            warned.add("top logprobs")
        return None, None
    own = (piece.get("token"), logprob)
    if len(entries) < 2 or own not in entries or any(lp is None for _, lp in entries):
        return None, None
    entries.remove(own)
    text, best = max(entries, key=lambda e: e[1])
    return (text, logprob - best) if logprob >= best else (None, None)


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
