"""The local backend's two engines: plain decoding (baseline) and speculative decoding.

Both are generators of engine.events: tokens as they commit, one StepRecord per target forward pass, policy
decisions, and the RunResult last. They share the prefill call, the token selection and the stop conditions, so
that greedy speculative output equals the baseline's token for token.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generator, Iterator

import torch

from engine.events import Event, RunResult, StepRecord, TokenEvent, TokenKind
from engine.exact.forward import forward, new_cache, rollback
from engine.metrics import run_metrics
from engine.exact.policy import SpecPolicy
from engine.exact.proposers import Proposal
from engine.exact.sampling import next_token, rejection_sample, runners_up, verify_greedy, warp
from engine.sampling_params import SamplingParams
from engine.stops import Detokenizer, StopConditions, Transcript
from engine.exact.tree import Tree

log = logging.getLogger(__name__)


class _Recorder:
    """Builds the RunResult while the engine runs and turns each commit into an event."""

    def __init__(self, engine: str, method: str, tokenizer, prompt_ids: list[int], stops: StopConditions, clock):
        self.clock = clock
        self.t0 = clock()
        self.result = RunResult(engine=engine, method=method, prompt_tokens=len(prompt_ids))
        self.transcript = Transcript(Detokenizer(tokenizer), stops)
        self.prompt_ids = prompt_ids
        self.rejected_step, self.rejected = None, None  # the step whose drafts `rejected` reads on from its text

    def now(self) -> float:
        return self.clock() - self.t0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.transcript.ids

    @property
    def done(self) -> bool:
        return self.transcript.finish_reason is not None

    def commit(self, kind, token, step, position, p=None, q=None, tie=(None, None)) -> TokenEvent:
        """`tie`: the target's runner-up and margin there (greedy), or (None, None)."""
        index = len(self.transcript.ids)
        text = self.transcript.commit(token)
        event = TokenEvent(kind, token, text, step, position, self.now(), index, p, q, runner_up=tie[0], margin=tie[1])
        self.result.tokens.append(event)
        return event

    def reject(self, token, step, position, p=None, q=None) -> TokenEvent:
        # A rejected draft reads on from the committed text and the drafts rejected before it in this step (decoded
        # alone, part of a multi-byte character would show as U+FFFD); a special token, which has no text in the
        # output, shows its own.
        if self.rejected_step != step:
            self.rejected_step, self.rejected = step, self.transcript.detok.fork()
        text = self.rejected.push(token)
        if not text and not self.rejected.incomplete:
            text = self.rejected.tokenizer.decode([token], skip_special_tokens=False)
        event = TokenEvent(TokenKind.REJECTED, token, text, step, position, self.now(), None, p, q)
        self.result.tokens.append(event)
        return event

    def step(self, step, drafted, accepted, emitted, draft_ms, verify_ms, drafter="", ignored=0) -> StepRecord:
        record = StepRecord(step, drafted, accepted, emitted, draft_ms, verify_ms, self.now(), drafter, ignored)
        self.result.steps.append(record)
        return record

    def finish(self, cancelled: bool = False, error: BaseException | None = None) -> RunResult:
        r = self.result
        r.output_ids = list(self.transcript.ids)
        r.output_text = self.transcript.detok.text
        r.finish_reason = self.transcript.finish_reason or ("cancelled" if cancelled else "")
        if error is not None:
            r.finish_reason, r.error = "error", f"{type(error).__name__}: {error}"
        r.total_s = self.now()
        r.metrics = run_metrics(r)
        return r


def _generator(params: SamplingParams, device) -> torch.Generator:
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def _ms_since(t: float) -> float:
    return 1000 * (time.perf_counter() - t)


def generate_baseline(
    model, tokenizer, prompt_ids: list[int], params: SamplingParams, stops: StopConditions,
    cancel: threading.Event | None = None, clock: Callable[[], float] = time.perf_counter,
) -> Iterator[Event]:
    """Plain autoregressive decoding: one target forward pass per token.

    `clock` times the run (token timestamps, total); a console that interleaves the two engines gives each a clock
    that stops while the other engine computes."""
    run = _Recorder("baseline", "none", tokenizer, prompt_ids, stops, clock)
    try:
        g = _generator(params, model.device)
        cache = new_cache(model)
        t = time.perf_counter()
        logits = forward(model, prompt_ids, cache, keep=1)  # [1, V]
        run.result.prefill_ms = ms = _ms_since(t)
        step = 0
        while True:
            token, p = next_token(logits[-1], params, g)
            tie = [x[0] for x in runners_up(logits[-1:])] if params.greedy else (None, None)
            yield run.commit(TokenKind.BASELINE, token, step, 0, p=None if params.greedy else p, tie=tie)
            yield run.step(step, 0, 0, 1, 0.0, ms)
            if run.done or _cancelled(cancel):
                break
            t = time.perf_counter()
            logits = forward(model, [token], cache, keep=1)
            ms = _ms_since(t)
            step += 1
    except Exception as e:  # noqa: BLE001 - the run is saved as failed, with what it produced so far
        log.exception("baseline run failed")
        yield run.finish(error=e)
        return
    yield run.finish(cancelled=_cancelled(cancel))


# --- speculative decoding: each step is draft -> verify -> accept -> commit, one plain function each ------------


def generate_speculative(
    model, tokenizer, proposer, prompt_ids: list[int], params: SamplingParams, stops: StopConditions,
    policy: SpecPolicy, cancel: threading.Event | None = None, clock: Callable[[], float] = time.perf_counter,
    tree_rows: int = 0,
) -> Iterator[Event]:
    """Speculative decoding: each step the proposer drafts K tokens, the target verifies them in one forward pass,
    and the step commits the accepted drafts and one token of the target's own (the terms: engine.exact.sampling).

    Step 0 drafts from the prompt alone, and the target reads the prompt and those drafts in one pass (its prefill):
    a request costs no target pass more than its steps. A step with K = 0 (nothing drafted, or speculation switched
    off by the policy) is a plain decoding step. `tree_rows`: greedy passes of fewer rows also verify a token tree in
    their free rows (engine.exact.tree); 0: never."""
    run = _Recorder("speculative", proposer.method, tokenizer, prompt_ids, stops, clock)
    try:
        g = _generator(params, model.device)
        proposer.generator = g  # one seeded stream for draft and target: a seed reproduces the run
        cache = new_cache(model)
        step = 0
        while not run.done and not _cancelled(cancel):
            ids = run.ids
            read = cache.get_seq_length()  # the target has read all committed ids but the last (at step 0: none)
            k = min(policy.next_k(), run.transcript.remaining - 1)  # a step commits up to k+1: never overshoot
            draft = _draft(proposer, ids, k, policy, params, tree_rows, prompt_pass=read == 0)
            logits, verify_ms = _verify(model, cache, ids, read, draft)
            if step == 0:
                run.result.prefill_ms = verify_ms
            verdict = _accept(draft, logits, params, g, cache, len(ids))
            emitted = yield from _commit(run, step, draft, verdict)
            # a stop before the step's first rejection: its committed tokens are all accepted drafts, and the
            # drafts after them are ignored (engine.exact.sampling)
            ignored = len(draft.ids) - emitted if emitted <= verdict.refused_from else 0
            accepted = emitted if ignored else len(verdict.accepted)
            record = run.step(step, len(draft.ids), accepted, emitted, draft.ms, verify_ms, draft.drafter, ignored)
            yield record
            for event in policy.observe(record):
                run.result.policy.append(event)
                yield event
            step += 1
    except Exception as e:  # noqa: BLE001 - the run is saved as failed, with what it produced so far
        log.exception("speculative run failed")
        yield run.finish(error=e)
        return
    yield run.finish(cancelled=_cancelled(cancel))


@dataclass
class _Draft:
    """What the draft phase hands to the target."""

    ids: list[int]  # [K] the drafts
    probs: torch.Tensor | None  # q [K, V], the draft's warped distributions; None: greedy, or a deterministic drafter
    tree: Tree  # a token tree's alternatives to one of the drafts (engine.exact.tree); most steps have none
    drafter: str  # who drafted ("" when K = 0)
    ms: float


@dataclass
class _Verdict:
    """What the accept phase decided: the step's output is `accepted` + [token]."""

    accepted: list[int]  # [n] the accepted drafts (after a tree's win: its alternative last)
    refused_from: int  # the first rejected draft: drafts[refused_from:] are rejected (K: none)
    token: int  # the target's own token at position n
    kind: TokenKind  # its kind: recovered, bonus, or baseline (K = 0)
    p: torch.Tensor | None  # [K+1, V] the target's warped distributions; None: greedy
    # greedy: the target's runner-up and margin at positions 0..refused_from (rows of the drafts' chain; after a
    # tree's alternative the bonus comes from another row: not kept)
    ties: list[tuple[int, float]]


def _draft(proposer, ids: list[int], k: int, policy: SpecPolicy, params: SamplingParams, tree_rows: int,
           prompt_pass: bool) -> _Draft:
    """Up to k drafts continuing `ids`, and the alternatives the pass will verify with them."""
    t = time.perf_counter()
    proposal = proposer.propose(ids, k, policy.draft_stop()) if k > 0 else Proposal([], None)
    drafts = proposal.ids[:k]
    tree = Tree.plan(proposal, len(drafts), tree_rows, params.greedy, prompt_pass)
    return _Draft(drafts, proposal.probs, tree, proposal.drafter if drafts else "", _ms_since(t))


def _verify(model, cache, ids: list[int], read: int, draft: _Draft) -> tuple[torch.Tensor, float]:
    """One target pass over the ids it has not read (the last committed one; at step 0 the prompt), the drafts and
    the alternatives -> (logits [K+1+A, V], ms): the target's scores after the last committed id, after each draft and
    after each alternative. At step 0 the prompt's rows are computed as the baseline's prefill computes them, so that
    the caches agree."""
    K, A = len(draft.ids), len(draft.tree.alternatives)
    t = time.perf_counter()
    logits = forward(model, ids[read:] + draft.ids + draft.tree.alternatives, cache, keep=K + 1 + A,
                     prompt_rows=len(ids) if read == 0 else None, tree=A, tree_at=draft.tree.row)
    return logits, _ms_since(t)


def _accept(draft: _Draft, logits: torch.Tensor, params: SamplingParams, g: torch.Generator, cache,
            committed: int) -> _Verdict:
    """Which drafts the target accepts and its own next token; the cache keeps the `committed` ids and the accepted
    drafts (the new token is fed next step)."""
    K = len(draft.ids)
    p = None if params.greedy else warp(logits, params)  # [K+1, V] (a tree is greedy only)
    if K == 0:
        accepted, token, refused_from = [], next_token(logits[-1], params, g)[0], 0
    else:
        d = torch.tensor(draft.ids, dtype=torch.long, device=logits.device)  # [K]
        if params.greedy:
            n, token = verify_greedy(d, logits[: K + 1])
            accepted, token, refused_from = draft.tree.accept(draft.ids, n, token, logits, cache, committed)
        else:
            n, token = rejection_sample(d, draft.probs, p, g)
            accepted, refused_from = draft.ids[:n], n
    n = len(accepted)
    ties = list(zip(*runners_up(logits[: refused_from + 1]))) if params.greedy else []
    rollback(cache, committed + n)
    # after a branch accepted whole (the chain, or a tree's alternative), the target's token is the bonus
    kind = TokenKind.BASELINE if K == 0 else TokenKind.BONUS if n == K or refused_from < n else TokenKind.RECOVERED
    return _Verdict(accepted, refused_from, token, kind, p, ties)


def _commit(run: _Recorder, step: int, draft: _Draft, verdict: _Verdict) -> Generator[TokenEvent, None, int]:
    """Commit the step's output tokens in order, the rejected drafts shown just before the output token that takes
    the first one's place, until a stop condition ends the run; returns how many were committed."""
    p, q, n = verdict.p, draft.probs, len(verdict.accepted)
    for i, token in enumerate(verdict.accepted + [verdict.token]):
        if i == verdict.refused_from:
            for r, rejected in enumerate(draft.ids[i:], i):
                yield run.reject(rejected, step, r, _prob(p, r, rejected), _prob(q, r, rejected))
        tie = verdict.ties[i] if i < len(verdict.ties) else (None, None)
        if i < n:  # sampled, a deterministic drafter's q is one-hot: 1 at its draft
            yield run.commit(TokenKind.ACCEPTED, token, step, i, _prob(p, i, token),
                             1.0 if q is None and p is not None else _prob(q, i, token), tie)
        else:
            yield run.commit(verdict.kind, token, step, i, _prob(p, i, token), tie=tie)
        if run.done:
            return i + 1
    return n + 1


def _prob(dist: torch.Tensor | None, position: int, token: int) -> float | None:
    return None if dist is None else float(dist[position, token])


def _cancelled(cancel: threading.Event | None) -> bool:
    return cancel is not None and cancel.is_set()


@torch.inference_mode()
def score_outputs(model, prompt_ids: list[int], outputs: list[list[int]]) -> list[list[float]]:
    """Log-probability of every token of each output given the prompt, under the target's raw distribution. The
    prompt is prefilled once; each output is then one forward pass from the cached prompt."""
    cache = new_cache(model)
    first = forward(model, prompt_ids, cache, keep=1)  # [1, V]: predicts each output's first token
    scores = []
    for out in outputs:
        if not out:
            scores.append([])
            continue
        rollback(cache, len(prompt_ids))
        logits = first if len(out) == 1 else torch.cat([first, forward(model, out[:-1], cache, keep=len(out) - 1)])
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        scores.append(logprobs[torch.arange(len(out)), torch.tensor(out)].tolist())
    return scores
