"""The llamacpp backend: llama.cpp servers, a baseline one and a speculative one (and up to three more speculative
ones for an N-way comparison), as an engine.backend.Backend.

Managed mode starts them on GGUF files (engine.llamacpp.server: llama-server built here for this CPU, or the user's
own, or the xllamacpp wheel where no build is possible; one process per engine), one after the other, each with the
machine's cores; they take turns in fair mode (both at once only where --llamacpp-threads leaves each engine cores of
its own and one for the console). Attach mode talks to llama-server instances someone already runs (their
/completion, /apply-template, /tokenize and /slots).

Drafting is each speculative engine's own configuration (method, K = draft n_max or the n-gram type's length,
n_min, p_min): this llama.cpp build accepts the per-request "speculative.n_max" / "n_min" / "p_min" fields without
applying them (tests/test_llamacpp.py measures that on the wheel), so the request's drafting settings are not applied
(ignored_settings) and reconfigure() restarts a managed engine with other ones.

Every token streams with its kind, exact where llama.cpp's per-token timings place it (engine.llamacpp.steps) and
`pending` where they cannot (a multi-byte character across target passes); nothing is guessed, so no Reclassified
follows. llama.cpp counts rejected drafts but never streams them: their text is unknown.

Where a speculative server exports its counters (llama-server --metrics: the managed engines are started with it),
they are read before and after each run (engine.serving.counters): the server's own count beside the run's, a
disagreement flagged. llama-server adds a request to its counters when it ends the request, right after its final
chunk, so the reading after the stream holds the run.

Greedy identity: llama.cpp verifies a pass's drafts in one batch, and a batch of several positions does not compute
bit for bit the numbers a single-token decoding step computes (other kernels, another summation order), so where
two tokens are nearly tied the speculative engine's greedy choice can differ from the baseline's: the check then
shows the first divergent token (DIVERGENCE_NOTE, saved with the run).
"""

from __future__ import annotations

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
from engine.events import Event, RunResult, StepRecord, TokenEvent, TokenKind
from engine.serving.http_safety import fetch, redact
from engine.llamacpp.client import is_last, parse_chunk, render_prompt, request_body
from engine.llamacpp.server import (DRAFT_MODEL_METHODS, K_RANGE, METHODS, WHEEL, EngineConfig, LlamaCppEngine,
                                    LlamaCppError, ServerBuild)
from engine.llamacpp.steps import StepTracker
from engine.metrics import run_metrics
from engine.request import Request
from engine.serving.backend import ServerBackend, start_in_turn
from engine.serving.stream import Cancelled, ServerError, stream_chunks

log = logging.getLogger(__name__)

WARM_UP_PROMPT = 'Repeat exactly: "alpha beta gamma delta epsilon"'
DIVERGENCE_NOTE = ("llama.cpp verifies drafts in one batched pass, whose numbers differ in the last bits from the "
                   "single-token decoding of the baseline; where two tokens are nearly tied, greedy picks differ")
DRAFTING_OPTIONS = ("n_min", "p_min", "ngram_n")  # EngineConfig's drafting settings besides method, K and draft
# the methods a method sweep runs unless told otherwise (EAGLE-3 and MTP need models made for them)
SWEEP_METHODS = ("draft", "ngram-simple", "ngram-map-k", "ngram-mod")
EXACT_NOTE = ("exact: llama.cpp's per-token timings (predicted_n, predicted_ms, draft_n, draft_n_accepted) place "
              "every token")


class LlamaCppBackend(ServerBackend):
    """engine.backend.Backend for a baseline llama.cpp server and 1..4 speculative ones (engine.serving.backend: what
    every server backend shares)."""

    name = "llamacpp"
    error = LlamaCppError
    counter_prefix = "llamacpp:spec_decode_"
    counters_hint = " (llama-server exports them when started with --metrics)"

    def __init__(self, urls: dict[str, str], configs: dict[str, EngineConfig | None], api_key: str | None = None,
                 servers: list[LlamaCppEngine] | None = None, stall_timeout: float = 60.0, slots: int = 1,
                 models: dict[str, str] | None = None):
        """`urls` and `configs`: engine name ("baseline", "speculative", "speculative-2" ...) -> its URL, and what it
        was started with (None where it is not known: an attached server). `slots`: the requests each serves at
        once. `models`: engine -> the GGUF it serves, as the server says."""
        if len(urls) - 2 > MAX_EXTRA:
            raise LlamaCppError(f"at most {MAX_EXTRA} extra speculative engines, got {len(urls) - 2}")
        self.urls = {engine: url.rstrip("/") for engine, url in urls.items()}
        self.configs, self.servers, self.stall_timeout = dict(configs), servers or [], stall_timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.models = models or {}
        # the draft GGUF the engines were given: a method sweep that passes through n-gram drafting returns to it
        self.draft_path = next((c.draft for c in self.configs.values() if c is not None and c.draft), None)
        # each engine on cores of its own, with a core left for the console (cores_left_over), can run at once
        # without slowing the other; else fair mode takes turns
        own = bool(self.servers) and cores_left_over(sum(e.config.threads for e in self.servers))
        sweep = tuple(m for m in SWEEP_METHODS if m not in DRAFT_MODEL_METHODS or self.draft_path)
        self.capabilities = Capabilities(knows_rejected=False, per_request_drafting=False,
                                         can_reconfigure=len(self.servers) >= 2, concurrent_requests=slots > 1,
                                         fair_strategy="parallel" if own else "sequential", fixed_variants=True,
                                         methods=tuple(METHODS), sweep_methods=sweep, k_range=K_RANGE)

    # --- set-up ----------------------------------------------------------------------------------------------------

    @classmethod
    def managed(cls, speculative: EngineConfig, extra: list[EngineConfig] | tuple = (), log_dir: Path | None = None,
                on_progress: Callable | None = None, python: str = sys.executable,
                build: ServerBuild = ServerBuild(None, WHEEL)) -> "LlamaCppBackend":
        """Start the baseline engine (the speculative config's target, no drafting), the speculative one and one per
        config in `extra`, one after the other (each load has the machine to itself), then warm them up. `build`:
        which llama.cpp serves them (engine.llamacpp.server.choose_build)."""
        if len(extra) > MAX_EXTRA:
            raise LlamaCppError(f"at most {MAX_EXTRA} extra speculative engines, got {len(extra)}")
        baseline = EngineConfig("baseline", speculative.model, threads=speculative.threads, ctx=speculative.ctx,
                                api_key=speculative.api_key)
        configs = [baseline, replace(speculative, role="speculative"),
                   *[replace(c, role=extra_engine(i)) for i, c in enumerate(extra)]]
        log_dir = log_dir or Path(tempfile.mkdtemp(prefix="specconsole-llamacpp-"))
        engines = start_in_turn([LlamaCppEngine(config, log_dir, python, build) for config in configs], on_progress,
                                lambda e: f"the {e.config.role} llama.cpp engine ({e.config.label()})")
        backend = cls({e.config.role: e.url for e in engines}, {e.config.role: e.config for e in engines},
                      speculative.api_key, engines, models={e.config.role: e.config.model for e in engines})
        backend.warmed_up()
        if on_progress:
            on_progress("llama.cpp engines ready", len(configs), len(configs))
        return backend

    @classmethod
    def attach(cls, urls: list[str], api_key: str | None = None,
               configs: list[EngineConfig | None] | None = None) -> "LlamaCppBackend":
        """Running llama.cpp servers: the baseline's URL, then the speculative ones'. Checks that all serve the same
        model and that the first does not speculate and the others do (each server's /slots says so)."""
        if not 2 <= len(urls) <= 2 + MAX_EXTRA:
            raise LlamaCppError(f"expected a baseline URL and 1 to {1 + MAX_EXTRA} speculative URLs, got {len(urls)}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        names = ["baseline", "speculative", *[extra_engine(i) for i in range(len(urls) - 2)]]
        models, speculates, slots = {}, {}, []
        for name, url in zip(names, urls):
            url = url.rstrip("/")
            try:
                props = _json(url + "/props", headers)
                slot_list = _json(url + "/slots", headers) if props.get("endpoint_slots", True) else None
            except (httpx.HTTPError, ValueError, ServerError) as e:
                raise LlamaCppError(f"cannot reach a llama.cpp server at {redact(url)}: {redact(str(e))}") from e
            models[name] = str(props.get("model_path") or "?")
            slots.append(int(props.get("total_slots") or 1))
            if isinstance(slot_list, list) and slot_list and isinstance(slot_list[0], dict) \
                    and "speculative" in slot_list[0]:
                speculates[name] = bool(slot_list[0]["speculative"])
        if len({Path(m).name for m in models.values()}) != 1:
            raise LlamaCppError("the servers serve different models: " + ", ".join(
                f"{name} {Path(m).name}" for name, m in models.items()))
        wrong = [name for name, on in speculates.items() if on != (name != "baseline")]
        if wrong:
            raise LlamaCppError("expected the first server without and the others with speculative decoding; "
                                + ", ".join(f"{name} ({redact(urls[names.index(name)])}) "
                                            f"{'speculates' if speculates[name] else 'does not speculate'}"
                                            for name in wrong))
        unknown = [name for name in names if name not in speculates]
        if unknown:
            log.warning("cannot tell whether %s speculate (their /slots is off): their tokens show as plain "
                        "decoding unless the server counts drafts", ", ".join(unknown))
        configs = list(configs or []) + [None] * (len(urls) - len(configs or []))
        return cls(dict(zip(names, urls)), dict(zip(names, configs)), api_key, slots=min(slots), models=models)

    def warm_up(self) -> None:
        """One short run per engine: the first request of a server pays one-off costs (allocations, the draft's
        context) that would otherwise land in the first run's TTFT."""
        t0 = time.perf_counter()
        for engine in self.urls:
            req = Request(prompt=WARM_UP_PROMPT, max_new_tokens=16)
            result = list(self._stream(engine, req, None, time.perf_counter))[-1]
            if result.error:
                raise LlamaCppError(f"warming up: {result.error}")
        log.info("llama.cpp engines warmed up in %.1f s", time.perf_counter() - t0)

    def reconfigure(self, drafting: Drafting) -> None:
        """Restart the managed speculative engine with other drafting (a method of METHODS, K, the draft GGUF for
        the draft methods, and EngineConfig's n_min, p_min and ngram_n as options). If the new one fails to start,
        the old one runs again and the error is raised."""
        self.capabilities.check_k(drafting.k)
        old = self.managed_speculative()
        if drafting.method not in METHODS:
            raise LlamaCppError(f"unknown llama.cpp method {drafting.method!r}; methods: {', '.join(METHODS)}")
        options = dict(drafting.options)
        unknown = set(options) - set(DRAFTING_OPTIONS)
        if unknown:
            raise LlamaCppError(f"unknown llama.cpp drafting settings: {', '.join(sorted(unknown))}")
        draft = None  # n-gram drafting loads no draft model
        if drafting.method in DRAFT_MODEL_METHODS:
            draft = drafting.draft or old.config.draft or self.draft_path
        config = replace(old.config, method=drafting.method, k=drafting.k, draft=draft, **options)

        def engine(config: EngineConfig) -> LlamaCppEngine:
            return LlamaCppEngine(config, old.log_path.parent, old.python, old.build)

        self.restart_speculative(engine(config), lambda: engine(old.config),
                                 lambda: self.configs.update(speculative=self.servers[1].config))

    def drafting(self) -> Drafting | None:
        """The speculative engine's drafting, as reconfigure() takes it (None where it is not known: attached)."""
        config = self.configs.get("speculative")
        if config is None:
            return None
        return Drafting(config.method, config.k, config.draft,
                        tuple((name, getattr(config, name)) for name in DRAFTING_OPTIONS))

    # --- what it is ------------------------------------------------------------------------------------------------

    def describe(self) -> dict:
        config = self.configs.get("speculative")
        model = self.models.get("speculative") or (config.model if config else None)
        draft = config.draft if config and config.draft else None
        return {"backend": "llamacpp", "target_model": Path(model).name if model else None,
                "draft_model": Path(draft).name if draft else None,
                "method": f"llamacpp-{config.method}" if config else "llamacpp",
                "label": f"llamacpp-{config.method}" if config else "llamacpp"}

    def variants(self) -> dict[str, dict]:
        return {engine: {"label": config.label() if config else "llama.cpp (config not given)",
                         "method": config.method if config else "llamacpp"}
                for engine, config in self.configs.items() if engine not in ("baseline", "speculative")}

    def validate(self, req: Request) -> None:
        req.validate()  # the server tokenizes; a prompt too long for its context comes back as the run's error
        # the request's K is not applied (ignored_settings): the engine's own is checked by reconfigure()

    def memory(self) -> dict | None:
        """The GGUF files the managed engines loaded (each engine holds its own copy of the target) vs this
        machine's memory; None for attached servers, whose memory is theirs."""
        if not self.servers:
            return None
        import psutil

        gb = 1 << 30
        target = sum(os.path.getsize(e.config.model) for e in self.servers) / gb
        draft = sum(os.path.getsize(e.config.draft) for e in self.servers if e.config.draft) / gb
        return {"target_gb": target, "draft_gb": draft, "needed_gb": target + draft,
                "available_gb": psutil.virtual_memory().total / gb}

    # --- runs ------------------------------------------------------------------------------------------------------

    def _stream(self, engine: str, req: Request, cancel, clock) -> Iterator[Event]:
        req.validate()
        config = self.configs.get(engine)
        method = "none" if engine == "baseline" else f"llamacpp-{config.method}" if config else "llamacpp"
        result = RunResult(engine=engine, method=method, prompt_tokens=0)
        tracker = StepTracker(engine != "baseline")
        url = self.urls[engine]
        content, gaps, final, warned = [], [], None, set()
        before = self.scrape(engine) if engine != "baseline" else None
        t0 = clock()
        try:
            prompt = render_prompt(url, self.headers, req)
            t0 = clock()  # both engines render the prompt first: their clocks start at the request
            try:
                for chunk in stream_chunks(url + "/completion", request_body(req, prompt), self.headers,
                                           self.stall_timeout, cancel, parse=parse_chunk, last=is_last):
                    now = clock() - t0
                    content.append(chunk.text)
                    for event in self._tokens(engine, chunk, tracker.feed(chunk.metrics, len(chunk.tokens), now,
                                                                           warned), result, gaps, now):
                        yield event
                    if chunk.finish_reason:
                        final, result.finish_reason = chunk, chunk.finish_reason
            except Cancelled:
                result.finish_reason = "cancelled"
        except (httpx.HTTPError, ServerError, ValueError) as e:
            what = "stopped answering" if isinstance(e, httpx.TimeoutException) else "failed"
            result.finish_reason = "error"
            result.error = redact(f"the {engine} llama.cpp engine {what}: {type(e).__name__}: {e}")
            log.warning("%s", result.error)
        result.total_s = clock() - t0
        result.output_text = "".join(content)
        if gaps and not result.error:
            self._fill_ids(url, result, gaps)
        self._finish(engine, result, tracker, final)
        if engine != "baseline":
            # a stop inside a pass cuts its accepted drafts from the placed steps; the server counted them all
            self.counted(engine, before, result, cut=tracker.accepted - (result.metrics.accepted or 0))
        yield result

    def _tokens(self, engine: str, chunk, placements: list, result: RunResult, gaps: list,
                now: float) -> Iterator[TokenEvent]:
        """TokenEvents for a chunk. Its ids are those of its last tokens: a token that ended inside a UTF-8
        character streamed without an id of its own (-1 until _fill_ids finds it), and without text ("")."""
        ids = [t.token_id for t in chunk.tokens]
        count = max(len(placements), len(ids))
        placements = placements + [None] * (count - len(placements))
        missing = count - len(ids)
        if missing:
            gaps.append((len(result.tokens), count, chunk.text, ids))
        for i, placement in enumerate(placements):
            index = len(result.tokens)
            token_id = ids[i - missing] if i >= missing else -1
            text = chunk.text if i == count - 1 else ""
            if engine == "baseline":
                event = TokenEvent(TokenKind.BASELINE, token_id, text, index, 0, now, index)
            elif placement is None:
                event = TokenEvent(TokenKind.PENDING, token_id, text, 0, 0, now, index)
            else:
                event = TokenEvent(placement[0], token_id, text, placement[1], placement[2], now, index)
            result.tokens.append(event)
            yield event

    def _fill_ids(self, url: str, result: RunResult, gaps: list) -> None:
        """The ids of tokens that streamed without one, from the server's tokenizer: a chunk's text tokenized
        alone, taken only where it gives the chunk's number of tokens and ends with the ids the chunk did bring.
        New events in result.tokens (those already yielded stay as they were)."""
        unknown = 0
        for start, count, text, known in gaps:
            ids = None
            if text:
                try:
                    resp = fetch("POST", url + "/tokenize", json={"content": text, "add_special": False},
                                 headers=self.headers, timeout=30)
                    tokens = resp.json().get("tokens") if resp.status_code == 200 else None
                    if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                        ids = tokens
                except (httpx.HTTPError, ValueError, ServerError) as e:
                    log.warning("could not tokenize a chunk's text to find its token ids: %s", redact(str(e)))
            if ids is None or len(ids) != count or ids[count - len(known):] != known:
                unknown += count - len(known)
                continue
            for i in range(count - len(known)):
                result.tokens[start + i] = replace(result.tokens[start + i], token_id=ids[i])
        result.metrics.unknown_token_ids = unknown
        if unknown:
            log.warning("%d tokens of the %s run kept no id: llama.cpp streams none for a token that ends inside a "
                        "UTF-8 character, and its tokenizer did not give them back", unknown, result.engine)

    def _finish(self, engine: str, result: RunResult, tracker: StepTracker, final) -> None:
        """Steps, the server's own figures and how exact the marks are, into the result and its metrics."""
        timings = (final.metrics if final else None) or {}
        result.prefill_ms = float(timings.get("prompt_ms") or 0.0) if isinstance(timings.get("prompt_ms"),
                                                                                  (int, float)) else 0.0
        usage = (final.usage if final else None) or {}
        result.prompt_tokens = usage.get("prompt_tokens") or 0
        result.output_ids = [t.token_id for t in result.output_tokens]
        n = len(result.tokens)
        if engine == "baseline":
            previous = None
            for p in tracker.passes[:n]:
                verify = p.ms - previous if p.ms is not None and previous is not None else 0.0
                previous = p.ms if p.ms is not None else previous
                result.steps.append(StepRecord(p.step, 0, 0, 1, 0.0, max(verify, 0.0), p.time_s))
            result.metrics = replace(run_metrics(result), unknown_token_ids=result.metrics.unknown_token_ids)
            return
        passes = [p for p in tracker.passes if p.emitted]
        placed = tracker.exact and sum(p.emitted for p in passes) == n \
            and sum(p.drafted for p in passes) == tracker.drafted
        if placed:
            # a pass's time covers drafting and verifying together: llama.cpp does not time them apart
            result.steps = [StepRecord(p.step, p.drafted, min(p.accepted, p.emitted), p.emitted, 0.0, 0.0, p.time_s)
                            for p in passes]
        rejected = tracker.drafted - tracker.accepted
        result.metrics = replace(run_metrics(result), unknown_token_ids=result.metrics.unknown_token_ids,
                                 server={"drafted": tracker.drafted, "accepted": tracker.accepted},
                                 rejected_drafts=rejected, divergence_note=DIVERGENCE_NOTE)
        if placed:
            result.metrics.highlighting = f"{EXACT_NOTE}; {rejected} rejected drafts, their text unknown"
            return
        if not tracker.counted:
            why = "the server sent no per-token counts (timings_per_token), or counts that do not add up"
        else:
            why = tracker.why or "tokens could not be placed"
        result.metrics = result.metrics.steps_unknown(
            drafted=tracker.drafted, accepted=tracker.accepted,
            acceptance_rate=tracker.accepted / tracker.drafted if tracker.drafted else None,
            highlighting=f"exact except {tracker.pending} pending tokens ({why}); the counts are llama.cpp's own; "
                         "target passes unknown")

    # --- the sampling check and the concurrency sweep ----------------------------------------------------------------

    def score(self, req: Request, outputs: list[list[int]]) -> list[list[float]]:
        """Log-probability of each token of each output under the target (raw distribution), as the baseline engine
        computes it: the output forced token by token with a grammar of its token ids (llama.cpp's `<[id]>`), greedy,
        with each chosen token's probability before sampling (n_probs, post_sampling_probs off)."""
        url = self.urls["baseline"]
        try:
            prompt = render_prompt(url, self.headers, req)
        except (httpx.HTTPError, ServerError, ValueError) as e:
            raise LlamaCppError(f"the baseline llama.cpp engine could not render the prompt: {redact(str(e))}") from e
        return [self._score_one(url, prompt, list(out)) for out in outputs]

    def _score_one(self, url: str, prompt: str, out: list[int]) -> list[float]:
        if not out:
            return []
        if min(out) < 0:
            raise LlamaCppError("the output has tokens whose ids llama.cpp did not stream (inside a UTF-8 "
                                "character): they cannot be scored")
        # an end-of-generation token cannot be forced by id: llama.cpp's grammar lets the output end there instead,
        # and the greedy pick among what may follow a complete grammar is that token (checked below)
        for forced in (out, out[:-1]):
            body = {"prompt": prompt, "max_tokens": len(out), "temperature": 0, "n_probs": 1,
                    "post_sampling_probs": False, "grammar": "root ::= " + " ".join(f"<[{t}]>" for t in forced),
                    "cache_prompt": False, "stream": False, "return_tokens": True}
            try:
                resp = fetch("POST", url + "/completion", json=body, headers=self.headers, timeout=300)
                data = resp.json() if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError, ServerError) as e:
                raise LlamaCppError(f"the baseline llama.cpp engine could not score an output: {redact(str(e))}"
                                    ) from e
            if data is not None or "empty grammar stack" not in resp.text or not forced:
                break
        if data is None:
            raise LlamaCppError(f"the baseline llama.cpp engine answered {resp.status_code} to scoring: "
                                f"{resp.text[:300]}")
        probs = data.get("completion_probabilities") or []
        ids = [p.get("id") for p in probs if isinstance(p, dict)]
        if data.get("tokens") != out or ids != out:
            raise LlamaCppError(f"llama.cpp scored {len(ids)} of the output's {len(out)} tokens: it reports no "
                                "log-probability for a token that ends inside a UTF-8 character")
        return [float(p["logprob"]) for p in probs]

    def throughput(self, engine: str, prompts: list[str], max_new_tokens: int,
                   cancel: threading.Event | None = None) -> tuple[int, float]:
        """All prompts at once (greedy), to servers that serve several requests at once (--parallel). Each request
        streams, so that `cancel` closes the ones still open; the finished ones count."""
        if not self.capabilities.concurrent_requests:
            raise LlamaCppError("these llama.cpp servers serve one request at a time (one slot): the concurrency "
                                "sweep needs servers started with --parallel N")
        url = self.urls[engine]

        def one(prompt: str) -> int:
            req = Request(prompt=prompt, max_new_tokens=max_new_tokens)
            body = request_body(req, render_prompt(url, self.headers, req))
            tokens = 0
            try:
                for chunk in stream_chunks(url + "/completion", body, self.headers, self.stall_timeout, cancel,
                                           parse=parse_chunk, last=is_last):
                    tokens = (chunk.usage or {}).get("completion_tokens") or tokens + len(chunk.tokens)
            except Cancelled:
                return 0
            return tokens

        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            tokens = list(pool.map(one, prompts))
        return sum(tokens), time.perf_counter() - start


def _json(url: str, headers: dict):
    resp = fetch("GET", url, headers=headers, timeout=10)
    if resp.status_code != 200:
        raise LlamaCppError(f"{redact(url)} answered {resp.status_code}: {resp.text[:200]}")
    return resp.json()
