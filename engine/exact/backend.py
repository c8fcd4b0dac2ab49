"""The local backend: a target (and optionally a draft) in this process, our own exact engines (engine.exact.decode)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Iterator

from engine.exact import tree
from engine.events import Event
from engine.exact.decode import generate_baseline, generate_speculative, score_outputs
from engine.methods import PROPOSERS, needs_draft
from engine.exact.models import LoadedModel, ModelError, check_pair, load, pick_device
from engine.presets import PRESETS, Preset
from engine.prompts import encode_prompt
from engine.exact.optimize import MIN_ROWS, free_rows
from engine.exact.precision import AUTO, resolve_precision
from engine.backend import K_RANGE, Capabilities
from engine.exact import calibration, grouped_int8, huge_pages, int8_store
from engine.exact.policy import Costs, PolicyConfig, SpecPolicy
from engine.exact.proposers import Draft
from engine.drafting import MIN_DRAFT_VOCAB, Drafting
from engine.request import Request
from engine.limits import SettingsError
from engine.stops import StopConditions
from engine.exact.vocab import PrunedHead, kept_ids, prune_head, token_ranking
from engine.loading.weights import Progress

log = logging.getLogger(__name__)


class LocalBackend:
    """engine.backend.Backend for our own engines: every drafting setting applies per request, and rejected drafts
    are known token by token. Both engines share the models, so fair mode alternates their passes."""

    name = "local"
    # the request's K, any that engine.limits allows (engine.exact.policy.PolicyConfig checks the same bounds)
    capabilities = Capabilities(knows_rejected=True, per_request_drafting=True, can_reconfigure=False,
                                concurrent_requests=False, fair_strategy="alternate", k_range=K_RANGE)

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, tree_rows: int | None = None):
        if draft is not None:
            check_pair(target, draft)
        self.target, self.draft = target, draft
        # the pass size a token tree fills up to (engine.exact.tree): rows a pass of fewer costs anyway; None: what
        # the target's Linears give (engine.exact.optimize.free_rows)
        self.tree_rows = free_rows(target.model) if tree_rows is None else tree_rows
        # the policy's cost model (engine.exact.calibration): from_preset reads the stored one; a backend built from
        # models directly measures its own at the first speculative run, and keeps it in memory only
        self.costs: Costs | None = None
        self.costs_about: dict = {}  # when and where the costs were measured, and their file
        self.stored_as: dict | None = None  # what the stored costs are filed under (from_preset); None: not stored
        self.memory_share: float | None = None  # this process's share of the device's memory (engine.process.split)
        self.heads: dict[int, PrunedHead] = {}  # FR-Spec: the draft's pruned output layer per vocabulary size
        # the target's Linears (engine.exact.precision; its name says so too, for the history), and why "auto" gave
        # float32 (from_preset sets them)
        self.precision, self.precision_note = "float32", None

    @classmethod
    def from_preset(
        cls, preset: Preset | str, device: str | None = None, min_rows: int = MIN_ROWS,
        on_progress: Progress | None = None, precision: str = "float32", calibrate: bool = True,
    ) -> "LocalBackend":
        """The preset's models, loaded; with `calibrate`, the policy's costs read (or measured and stored) now, so
        that no run measures them (a backend that never drafts, the baseline's alone, needs none)."""
        if isinstance(preset, str):
            if preset not in PRESETS:
                raise ModelError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
            preset = PRESETS[preset]
        dev = pick_device(device)
        if on_progress and precision == AUTO:
            on_progress("preparing the int4 kernel (compiled at the first start: about a minute)", 0, 1)
        precision, why = resolve_precision(precision, dev)
        if why:
            log.warning("the target runs in float32: %s", why)
        backend = cls._load_pair(preset, dev, min_rows, on_progress, precision)
        huge = 0
        if dev.type == "cpu" and precision in ("int8", "int4"):
            # once both have loaded: the draft's loading peak is over before all the target's weights are resident
            huge = huge_pages.move(backend.target.model, *([backend.draft.model] if backend.draft else []))
            log.info("the models: %.2f GB of their weights in huge pages", huge / 1e9)
        backend.precision, backend.precision_note = precision, why
        # the costs hold for these models in these forms on this kernel: a new form or kernel measures again
        backend.stored_as = backend.describe() | {"target": preset.target, "draft": preset.draft, "device": str(dev),
                                                  "min_rows": min_rows, "form": int8_store.FORMAT,
                                                  "kernel": grouped_int8.build_key(),
                                                  "pages": huge_pages.PLACEMENT if huge else "as loaded"}
        if calibrate:
            if on_progress:
                on_progress("the policy's costs (measured once per machine and models, then stored)", 0, 1)
            backend.calibrate()
        return backend

    @classmethod
    def _load_pair(cls, preset: Preset, dev, min_rows: int, on_progress: Progress | None,
                   precision: str) -> "LocalBackend":
        if not preset.draft:
            return cls(load(preset.target, "target", dev, min_rows=min_rows, on_progress=on_progress,
                            precision=precision), None)
        # both at once: each load keeps a core busy only part of the time (reading, dequantizing, packing take turns),
        # so together they start ~30 % sooner on two cores; the peak stays the two models plus one tensor each
        with ThreadPoolExecutor(2, thread_name_prefix="load") as pool:
            draft = pool.submit(load, preset.draft, "draft", dev, int8=preset.int8_draft, on_progress=on_progress,
                                precision=precision)  # an int4 target's draft runs on its kernel too
            target = pool.submit(load, preset.target, "target", dev, min_rows=min_rows, on_progress=on_progress,
                                 precision=precision)
            return cls(target.result(), draft.result())

    def calibrate(self, refresh: bool = False) -> Costs:
        """The policy's costs: stored ones where this backend is a preset's (measured and stored first if there are
        none, or with `refresh`), else measured now and kept for this backend's life."""
        if self.costs is None or refresh:
            draft = self.draft.model if self.draft else None
            if self.stored_as is None:
                self.costs = calibration.measure(self.target.model, draft)
                self.costs_about = {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "file": None}
            else:
                self.costs, self.costs_about = calibration.stored(self.stored_as, self.target.model, draft, refresh)
        return self.costs

    def calibration(self) -> dict:
        self.calibrate()
        return calibration.as_dict(self.costs, self.costs_about)

    def recalibrate(self) -> dict:
        self.calibrate(refresh=True)
        return self.calibration()

    def why_float32(self) -> str | None:
        """Why "auto" gave a float32 target (None: it runs as asked), for the status line."""
        return self.precision_note

    def variants(self) -> dict[str, dict]:
        return {}  # the extras of an N-way run are the page's presets (specconsole.variants), served per request

    def describe(self) -> dict:
        return {"backend": "local", "target_model": self.target.name,
                "draft_model": self.draft.name if self.draft else None}

    def memory(self) -> dict | None:
        """Weights in memory vs what the device has, for the advisor's "is there room for a second model"."""
        import psutil
        import torch

        if self.target.device.type == "cuda":
            available = torch.cuda.get_device_properties(self.target.device).total_memory
        else:
            available = psutil.virtual_memory().total
        gb = 1 << 30
        draft = self.draft.nbytes if self.draft else 0
        return {"target_gb": self.target.nbytes / gb, "draft_gb": draft / gb,
                "needed_gb": (self.target.nbytes + draft) / gb, "available_gb": available / gb,
                "device": str(self.target.device), "share": self.memory_share}

    def validate(self, req: Request) -> None:
        self.prompt_ids(req)

    def ignored_settings(self, req: Request) -> tuple[str, ...]:
        return req.drafting.server_settings_set()  # the draft model is loaded with the backend

    def drafting(self) -> None:
        return None  # the request's drafting settings apply, per run

    def reconfigure(self, drafting: Drafting) -> None:
        raise SettingsError("the local engines take their drafting settings with each run; nothing to restart")

    def throughput(self, engine: str, prompts: list[str], max_new_tokens: int,
                   cancel: threading.Event | None = None) -> tuple[int, float]:
        raise SettingsError("the in-process engines serve one request at a time: the concurrency sweep needs vLLM")

    def close(self) -> None:
        pass  # the models go with the process

    def prompt_ids(self, req: Request, drafting: bool = True) -> list[int]:
        """The prompt as the target's tokens, after checking that this backend can serve `req` (`drafting`: its
        drafting too; the baseline drafts nothing)."""
        req.validate()
        d = req.drafting
        if drafting:
            self.capabilities.check_k(d.k)
        if drafting and needs_draft(d.method) and self.draft is None:
            raise SettingsError(f"this setup has no draft model, which {d.method} drafting needs: choose n-gram "
                                "drafting or load a draft")
        if drafting and needs_draft(d.method) and d.draft_vocab > self.draft.vocab_size:
            raise SettingsError(f"the draft vocabulary (FR-Spec) must be 0 (full) or between {MIN_DRAFT_VOCAB} and "
                                f"the draft's {self.draft.vocab_size} tokens, got {d.draft_vocab}")
        ids = encode_prompt(self.target.tokenizer, req.prompt, req.chat, req.earlier_turns)
        room = self.target.max_context - req.max_new_tokens
        if len(ids) > room:
            raise SettingsError(
                f"the prompt is {len(ids)} tokens; with {req.max_new_tokens} new tokens that exceeds the model's "
                f"context of {self.target.max_context} tokens. Shorten the prompt or ask for fewer tokens."
            )
        return ids

    def stops(self, req: Request) -> StopConditions:
        return StopConditions(req.max_new_tokens, self.target.eos_ids, tuple(s for s in req.stop_strings if s))

    def baseline(self, req: Request, cancel: threading.Event | None = None, clock=time.perf_counter) -> Iterator[Event]:
        ids = self.prompt_ids(req, drafting=False)
        t = self.target
        yield from generate_baseline(t.model, t.tokenizer, ids, req.sampling, self.stops(req), cancel, clock)

    def score(self, req: Request, outputs: list[list[int]]) -> list[list[float]]:
        """Log-probability of each token of each output under the target (raw distribution, temperature 1), given the
        request's prompt: one prefill, then one forward pass per output over its tokens (for the sampling check)."""
        prompt = self.prompt_ids(req)
        return score_outputs(self.target.model, prompt, outputs)

    def speculative(self, req: Request, cancel: threading.Event | None = None, clock=time.perf_counter,
                    engine: str = "speculative") -> Iterator[Event]:
        # `engine` names no server here: an N-way run's extra engines differ in the request's drafting settings
        ids = self.prompt_ids(req)
        t = self.target
        tree_rows = self.tree_rows if req.drafting.token_tree else 0
        method = PROPOSERS[req.drafting.method]
        draft = Draft(self.draft.model, t.vocab_size, self.draft_head(req.drafting.draft_vocab),
                      alternatives=tree.width(tree_rows)) if method.needs_draft else None
        proposer = method.build(req, draft)
        costs = self.calibrate()
        if not method.needs_draft:  # n-gram lookup: a drafted token costs next to nothing
            costs = replace(costs, draft_ms_per_token=0.0)
        policy = SpecPolicy(PolicyConfig.of(req.drafting), costs=costs)
        yield from generate_speculative(
            t.model, t.tokenizer, proposer, ids, req.sampling, self.stops(req), policy, cancel, clock, tree_rows
        )

    def draft_head(self, n: int) -> PrunedHead | None:
        """The draft's output layer pruned to its n most frequent tokens (FR-Spec), built once per n (a second or
        so for the Qwen draft); None for the full layer (n = 0, or n covers it all)."""
        if not n or n >= self.draft.vocab_size:
            return None
        if n not in self.heads:
            if len(self.heads) >= 3:  # each size typed into the page costs up to a layer's memory: keep the latest
                del self.heads[next(iter(self.heads))]
            ids = kept_ids(token_ranking(self.draft.tokenizer), n, self.draft.vocab_size)
            self.heads[n] = prune_head(self.draft.model.get_output_embeddings(), ids)
            log.info("FR-Spec: the draft drafts among its %d most frequent tokens", n)
        return self.heads[n]
