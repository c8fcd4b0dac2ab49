"""The local backend's two engines: plain decoding (baseline) and speculative decoding.

Both are generators of engine.events: tokens as they commit, one StepRecord per target forward pass, policy
decisions, and the RunResult last. They share the prefill call, the token selection and the stop conditions, so
that greedy speculative output equals the baseline's token for token.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator

import torch

from engine.drafters import Proposal
from engine.events import Event, RunResult, StepRecord, TokenEvent, TokenKind
from engine.forward import forward, move_position, new_cache, rollback
from engine.metrics import run_metrics
from engine.policy import SpecPolicy
from engine.sampling import SamplingParams, next_token, rejection_sample, verify_greedy, warp
from engine.stops import Detokenizer, StopConditions, Transcript

log = logging.getLogger(__name__)


class _Recorder:
    """Builds the RunResult while the engine runs and turns each commit into an event."""

    def __init__(self, engine: str, method: str, tokenizer, prompt_ids: list[int], stops: StopConditions, clock):
        self.clock = clock
        self.t0 = clock()
        self.result = RunResult(engine=engine, method=method, prompt_tokens=len(prompt_ids))
        self.transcript = Transcript(Detokenizer(tokenizer), stops)
        self.prompt_ids = prompt_ids
        self.rejected = [None, [], ""]  # this step's rejected drafts: [step, their ids, the text they read as]

    def now(self) -> float:
        return self.clock() - self.t0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.transcript.ids

    @property
    def done(self) -> bool:
        return self.transcript.finish_reason is not None

    def commit(self, kind, token, step, position, p=None, q=None) -> TokenEvent:
        index = len(self.transcript.ids)
        text = self.transcript.commit(token)
        event = TokenEvent(kind, token, text, step, position, self.now(), index, p, q)
        self.result.tokens.append(event)
        return event

    def reject(self, token, step, position, p=None, q=None) -> TokenEvent:
        # A rejected draft reads on from the committed text and the drafts rejected before it in this step: decoded
        # alone, a token that holds part of a multi-byte character would show as U+FFFD.
        detok = self.transcript.detok
        if self.rejected[0] != step:
            self.rejected = [step, [], detok.text]
        drafts, shown = self.rejected[1], self.rejected[2]
        drafts.append(token)
        full = detok.tokenizer.decode(detok.ids + drafts, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if full.endswith("\ufffd"):
            text = ""  # an incomplete character, like a commit's: a later rejected draft shows it whole
        elif full.startswith(shown) and len(full) > len(shown):
            text, self.rejected[2] = full[len(shown):], full
        else:  # a special token (no text in the output): its own text
            text = detok.tokenizer.decode([token], skip_special_tokens=False)
        event = TokenEvent(TokenKind.REJECTED, token, text, step, position, self.now(), None, p, q)
        self.result.tokens.append(event)
        return event

    def step(self, step, drafted, accepted, emitted, draft_ms, verify_ms, drafter="") -> StepRecord:
        record = StepRecord(step, drafted, accepted, emitted, draft_ms, verify_ms, self.now(), drafter)
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
            yield run.commit(TokenKind.BASELINE, token, step, 0, p=None if params.greedy else p)
            yield run.step(step, 0, 0, 1, 0.0, ms)
            if run.done or (cancel is not None and cancel.is_set()):
                break
            t = time.perf_counter()
            logits = forward(model, [token], cache, keep=1)
            ms = _ms_since(t)
            step += 1
    except Exception as e:  # noqa: BLE001 - the run is saved as failed, with what it produced so far
        log.exception("baseline run failed")
        yield run.finish(error=e)
        return
    yield run.finish(cancelled=cancel is not None and cancel.is_set())


def generate_speculative(
    model, tokenizer, proposer, prompt_ids: list[int], params: SamplingParams, stops: StopConditions,
    policy: SpecPolicy, cancel: threading.Event | None = None, clock: Callable[[], float] = time.perf_counter,
    tree_rows: int = 0,
) -> Iterator[Event]:
    """Speculative decoding: the proposer drafts K tokens, the target verifies them in one forward pass and
    commits the accepted prefix plus one token of its own.

    Step 0 drafts from the prompt alone, and the target reads the prompt and those drafts in one pass (its prefill);
    a request then costs no target pass more than its steps. (With K = 0 step 0 is the baseline's prefill.)

    Greedy, a pass of fewer than `tree_rows` tokens (one that costs as much as `tree_rows`: engine.optimize pads it)
    fills its free rows with the draft's alternatives for the draft position where it was least sure (a token tree
    with one branching). When the target refuses the chain exactly there but its own token is one of the
    alternatives, that alternative is accepted and its row already holds the target's next token (the bonus): one
    token more than the chain alone commits."""
    run = _Recorder("speculative", proposer.method, tokenizer, prompt_ids, stops, clock)
    try:
        g = _generator(params, model.device)
        if hasattr(proposer, "generator"):
            proposer.generator = g  # one seeded stream for draft and target: a seed reproduces the run
        cache = new_cache(model)
        step = 0
        while not run.done and not (cancel is not None and cancel.is_set()):
            ids = run.ids
            read = cache.get_seq_length()  # the target has read all committed ids but the last (at step 0: none)
            k = min(policy.next_k(), run.transcript.remaining - 1)  # a step commits up to k+1: never overshoot
            t = time.perf_counter()
            proposal = proposer.propose(ids, k, policy.draft_stop()) if k > 0 else Proposal([], None)
            drafts = proposal.ids[:k]
            K = len(drafts)
            # the token tree: after step 0 (whose pass is the prompt's), greedy, in the rows the pass has free
            at = proposal.branch_at  # the draft the alternatives stand in for
            alts = proposal.alternatives[: max(0, tree_rows - K - 1)] if at < K and read and params.greedy else []
            draft_ms = _ms_since(t)

            t = time.perf_counter()
            # [K+1+A, V]: the logits after the last committed id, after each draft and after each alternative. At
            # step 0 the prompt's rows are computed as the baseline's prefill computes them, so that the caches agree.
            logits = forward(model, ids[read:] + drafts + alts, cache, keep=K + 1 + len(alts),
                             prompt_rows=len(ids) if read == 0 else None, tree=len(alts), tree_at=at + 1)
            verify_ms = _ms_since(t)
            if step == 0:
                run.result.prefill_ms = verify_ms

            p_all = None if params.greedy else warp(logits, params)  # [K+1, V] (a tree is greedy only)
            d = torch.tensor(drafts, dtype=torch.long, device=logits.device)  # [K]
            branch = None  # the accepted alternative's index, if the tree's branch won
            if K == 0:
                n, token = 0, next_token(logits[-1], params, g)[0]
            elif params.greedy:
                n, token = verify_greedy(d, logits[: K + 1])
                if n == at and token in alts:  # refused where the alternatives branch off, and one of them is it
                    branch = alts.index(token)
                    n, token = at + 1, int(logits[K + 1 + branch].argmax())
                    move_position(cache, len(ids) + K + branch, len(ids) + at)  # its keys replace the refused draft's
            else:
                n, token = rejection_sample(d, proposal.probs, p_all, g)
            rollback(cache, len(ids) + n)  # keep the committed tokens; the new token is fed next step
            accepted = drafts[:n] if branch is None else drafts[:at] + [alts[branch]]

            def prob(dist, pos, tok):
                return None if dist is None else float(dist[pos, tok])

            emitted = 0
            for i in range(n):
                if i == at and branch is not None:  # the chain was refused from here on; the alternative replaces it
                    for r in range(at, K):
                        yield run.reject(drafts[r], step, r)
                q = 1.0 if proposal.probs is None and p_all is not None else prob(proposal.probs, i, accepted[i])
                yield run.commit(TokenKind.ACCEPTED, accepted[i], step, i, prob(p_all, i, accepted[i]), q)
                emitted += 1
                if run.done:
                    break
            if not run.done:
                for i in range(n, K) if branch is None else ():
                    yield run.reject(drafts[i], step, i, prob(p_all, i, drafts[i]), prob(proposal.probs, i, drafts[i]))
                # after a branch accepted whole (the chain, or an alternative), the target's token is the bonus
                kind = TokenKind.BONUS if n == K or branch is not None else TokenKind.RECOVERED
                kind = TokenKind.BASELINE if K == 0 else kind
                yield run.commit(kind, token, step, n, prob(p_all, n, token))
                emitted += 1
            record = run.step(step, K, n, emitted, draft_ms, verify_ms, proposal.drafter if K else "")
            yield record
            for event in policy.observe(record):
                run.result.policy.append(event)
                yield event
            step += 1
    except Exception as e:  # noqa: BLE001 - the run is saved as failed, with what it produced so far
        log.exception("speculative run failed")
        yield run.finish(error=e)
        return
    yield run.finish(cancelled=cancel is not None and cancel.is_set())


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
