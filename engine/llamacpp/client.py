"""One streamed request to a llama.cpp server (llama-server, or an engine of engine.llamacpp.server): the prompt as
the server's chat template renders it, the request body for a Request, and each line of the stream as a
engine.serving.stream.Chunk, read by engine.serving.stream.stream_chunks (its limits, stall timeout and cancel).

llama.cpp's native /completion endpoint, not its OpenAI ones: only there does every streamed token bring its id
(return_tokens) without the cost of log-probabilities, which llama.cpp computes for plain decoding steps but not for
accepted drafts (asking for them would slow the baseline alone). Each chunk also carries llama.cpp's timings
(timings_per_token): predicted_n (tokens so far), predicted_ms (set once per target pass) and draft_n /
draft_n_accepted (running counts); engine.llamacpp.steps places the tokens from them. The stream ends with a chunk
that says "stop": true, not with [DONE].
"""

from __future__ import annotations

import json

from engine.serving.http_safety import fetch, number
from engine.prompts import chat_messages
from engine.request import Request
from engine.serving.stream import Chunk, StreamedToken, StreamError

# llama.cpp's stop_type -> the console's finish reason
FINISH = {"eos": "eos", "word": "stop", "limit": "length"}
# what a llama.cpp server samples with unless told otherwise (min_p 0.05, top_k 40, ...) is not the request's
NEUTRAL_SAMPLING = {"min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "top_n_sigma": -1.0}


def render_prompt(url: str, headers: dict, req: Request, timeout: float = 30.0) -> str:
    """The prompt text the server generates from: a chat request through the model's own chat template (the
    server's /apply-template, as its chat endpoint does), earlier turns included; else the plain text."""
    if not req.chat:
        return "\n".join([c for _, c in req.earlier_turns] + [req.prompt])
    resp = fetch("POST", url + "/apply-template", json={"messages": chat_messages(req.prompt, req.earlier_turns)},
                 headers=headers, timeout=timeout)
    if resp.status_code != 200:
        raise StreamError(f"/apply-template answered {resp.status_code}: {resp.text[:300]}")
    prompt = resp.json().get("prompt")
    if not isinstance(prompt, str):
        raise StreamError("/apply-template returned no prompt text")
    return prompt


def request_body(req: Request, prompt: str) -> dict:
    """The streamed /completion request for `req`: its sampling and nothing of the server's own defaults, every
    token's id and timings, and no prompt cache (each run pays its prefill, as the other engine's does)."""
    s = req.sampling
    body = {"prompt": prompt, "max_tokens": req.max_new_tokens, "stream": True, "return_tokens": True,
            "timings_per_token": True, "cache_prompt": False, "temperature": s.temperature, "top_k": s.top_k,
            "top_p": s.top_p, **NEUTRAL_SAMPLING}
    if s.seed is not None:
        body["seed"] = s.seed
    if req.stop_strings:
        body["stop"] = list(req.stop_strings)
    return body


def parse_chunk(payload: str, warned: set | None = None) -> Chunk:
    """One `data:` line of /completion as a Chunk: its token ids (the chunk's text goes with its last one),
    llama.cpp's timings in `metrics`, and on the last chunk the finish reason and usage. StreamError when it
    cannot be read."""
    try:
        data = json.loads(payload)
    except ValueError as e:
        raise StreamError(f"a stream chunk is not JSON ({e}): {payload[:200]!r}") from e
    if not isinstance(data, dict):
        raise StreamError(f"a stream chunk is not an object: {payload[:200]!r}")
    if data.get("error"):
        error = data["error"]
        raise StreamError(f"the server reported an error mid-answer: "
                          f"{error.get('message', error) if isinstance(error, dict) else error}")
    content, ids, timings = data.get("content", ""), data.get("tokens", []), data.get("timings")
    if not isinstance(content, str) or not isinstance(ids, list) or \
            not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids) or \
            not isinstance(timings, (dict, type(None))):
        raise StreamError(f"a stream chunk has an unexpected shape (content, tokens or timings): {payload[:200]!r}")
    if content and not ids and not data.get("stop"):
        raise StreamError("text without token ids: a server that ignores return_tokens")
    tokens = [StreamedToken(t, content if i == len(ids) - 1 else "", None) for i, t in enumerate(ids)]
    chunk = Chunk(tokens=tokens, text=content, metrics=timings)
    if data.get("stop") is True:
        chunk.finish_reason = FINISH.get(data.get("stop_type"), "stop")
        chunk.usage = {"prompt_tokens": number(data.get("tokens_evaluated"), "tokens_evaluated", integer=True,
                                               warned=warned),
                       "completion_tokens": number(data.get("tokens_predicted"), "tokens_predicted", integer=True,
                                                   warned=warned)}
    return chunk


def is_last(chunk: Chunk) -> bool:
    """The chunk that ends a /completion stream (llama.cpp sends no [DONE] there)."""
    return chunk.finish_reason is not None
