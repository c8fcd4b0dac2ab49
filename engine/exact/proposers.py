"""Proposers: what drafts for the speculative engine (engine.exact.decode). One protocol, three small implementations: a
draft model, prompt lookup, and a hybrid that picks one of the two per step. engine.methods.PROPOSERS registers them
under their method names.

A draft model keeps its own KV cache and never re-runs a token it has already seen: after a rejection its cache is
cropped back to the longest prefix it shares with the committed ids (at the next propose, so the engine need not say
what it committed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from engine.exact import tree
from engine.exact.forward import forward, new_cache, rollback
from engine.exact.sampling import sample, warp
from engine.sampling_params import SamplingParams
from engine.exact.vocab import PrunedHead

if TYPE_CHECKING:
    from engine.drafting import Drafting
    from engine.exact.policy import DraftStop
    from engine.request import Request


@dataclass
class Proposal:
    ids: list[int]  # up to k draft tokens
    probs: torch.Tensor | None  # q [len(ids), V] (warped like p); None when the proposer is deterministic
    drafter: str = ""  # the `method` of the proposer that made them: "draft" | "ngram" (saved as StepRecord.drafter)
    # greedy: the draft's next-best tokens, best first, for draft position `branch_at` (where it was least sure)
    alternatives: list[int] = field(default_factory=list)
    branch_at: int = 0


@runtime_checkable
class Proposer(Protocol):
    """What the speculative engine asks of a drafting method."""

    method: str  # its name in engine.methods.PROPOSERS, saved as the run's method
    generator: torch.Generator | None  # the engine's seeded stream, set before the first step (a seed repeats a run)

    def propose(self, ids: list[int], k: int, stop: DraftStop | None = None) -> Proposal:
        """Up to k draft tokens continuing `ids` (every committed token, prompt included), with their draft
        distributions q (None where the proposer is deterministic). `stop` may end a draft model's run earlier."""


@dataclass(frozen=True)
class Draft:
    """The loaded draft model, as the local backend lends it to a proposer that runs it."""

    model: torch.nn.Module
    vocab_size: int  # the target's logits width: q is padded to it
    head: PrunedHead | None = None  # FR-Spec: the output layer for the kept ids only (engine.exact.vocab)
    alternatives: int = 0  # greedy: next-best tokens to name for a token tree (engine.exact.tree)


class DraftModelProposer:
    """A smaller model from the same tokenizer family proposes up to k tokens autoregressively. It stops early when
    it is unsure: a draft token whose draft probability is below `confidence` is likely to be rejected, and every
    token drafted after it would be wasted; or when the policy's DraftStop says one more token would not pay (it
    counts an unsure token as worth nothing, and goes on past it only where a longer pass verifies faster).
    (Any rule that depends only on the draft's own state keeps the rejection sampler exact.) With a pruned output
    layer (`head`, FR-Spec) it drafts among the kept ids only, and q is 0 at every other id. Greedy, it also names
    its `alternatives` next-best tokens for the position where it was least sure (a token tree the target can verify
    in the rows a short pass leaves free; see engine.exact.tree)."""

    method = "draft"

    def __init__(
        self, model, vocab_size: int, params: SamplingParams, generator: torch.Generator | None,
        confidence: float = 0.0, head: PrunedHead | None = None, alternatives: int = 0,
    ):
        self.model = model
        self.confidence = confidence
        self.alternatives = alternatives
        self.head = head  # FR-Spec: the output layer for the kept ids only (engine.exact.vocab); None: the full layer
        self.vocab_size = vocab_size  # the target's logits width; q is padded to it
        self.params = params
        self.generator = generator
        self.cache = new_cache(model)
        self.cached: list[int] = []  # the tokens whose keys/values are in self.cache

    @classmethod
    def build(cls, req: Request, draft: Draft | None) -> DraftModelProposer:
        return cls(draft.model, draft.vocab_size, req.sampling, None, req.drafting.draft_confidence, draft.head,
                   draft.alternatives)

    def propose(self, ids: list[int], k: int, stop=None) -> Proposal:
        self.update(ids)
        feed = ids[len(self.cached) :]  # usually 1 or 2 tokens: the last committed ones
        drafts: list[int] = []
        probs = []
        alternatives, branch_at, least = [], 0, 2.0
        for _ in range(k):
            logits = forward(self.model, feed, self.cache, keep=1, head=self.head)[-1]  # [V_draft], or [N] kept
            self.cached += feed
            if self.params.greedy:
                i = int(logits.argmax())
                confidence = float(torch.softmax(logits, -1)[i]) if self.confidence or stop else 1.0
                if self.alternatives and confidence < least:  # the likeliest place for the target to disagree
                    alternatives = [self._id(j) for j in tree.runners_up(logits, i, self.alternatives)]
                    branch_at, least = len(drafts), confidence
            else:
                q = warp(logits, self.params)  # over the kept ids only, with a pruned head
                i = sample(q, self.generator)
                probs.append(q)
                confidence = float(q[i])
            token = self._id(i)
            drafts.append(token)
            unsure = confidence < self.confidence  # likely rejected, and every token drafted after it wasted
            if stop is None and unsure or stop is not None and not stop.more(0.0 if unsure else confidence):
                break
            feed = [token]
        # the last draft token was never fed: it sits in no cache yet
        q = None if self.params.greedy else self._pad(torch.stack(probs))
        return Proposal(drafts, q, self.method, alternatives, branch_at)

    def _id(self, i: int) -> int:
        """The token id of row i of the draft's output layer (a pruned head keeps a subset of ids)."""
        return i if self.head is None else int(self.head.ids[i])

    def update(self, ids: list[int]) -> None:
        """Crop the cache to the longest prefix it shares with `ids` (propose starts with it)."""
        keep = _common_prefix(self.cached, ids)
        if keep < len(self.cached):
            rollback(self.cache, keep)
            del self.cached[keep:]

    def _pad(self, q: torch.Tensor) -> torch.Tensor:
        if self.head is not None:  # q over the kept ids -> over all ids, 0 at those the pruned head cannot propose
            q = q.new_zeros(*q.shape[:-1], self.vocab_size).index_copy_(-1, self.head.ids.to(q.device), q)
        # A draft whose embedding matrix is narrower than the target's can never propose the extra ids: q = 0 there.
        if q.shape[-1] < self.vocab_size:
            q = torch.nn.functional.pad(q, (0, self.vocab_size - q.shape[-1]))
        return q[..., : self.vocab_size]


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from max_n down to min_n) in
    prompt + output and propose the tokens that followed it. Free to compute, and strong on code edits, RAG and
    summaries that copy from their input."""

    method = "ngram"
    generator = None  # deterministic: the engine's stream goes unused

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n

    @classmethod
    def build(cls, req: Request, draft: Draft | None) -> NgramProposer:
        return cls(req.drafting.ngram_min, req.drafting.ngram_max)

    def propose(self, ids: list[int], k: int, stop=None) -> Proposal:
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start : start + n] == tail:
                    return Proposal(ids[start + n : start + n + k], None, self.method)
        return Proposal([], None, self.method)


class HybridProposer:
    """Prompt lookup where the text is copying, the draft model elsewhere: each step tries the lookup first and
    runs the draft model only when no n-gram of at least `lookup.min_n` tokens matches. A long verbatim match
    (code edits, quoted JSON) predicts many tokens for free; a match of one or two tokens ("the", ", ") recurs
    everywhere and would replace a better draft model's guess. The choice depends only on the committed ids, so
    the rejection sampler stays exact: the n-gram's drafts verify with q = one-hot, the model's with its q."""

    method = "hybrid"

    def __init__(self, model: DraftModelProposer, lookup: NgramProposer):
        self.model, self.lookup = model, lookup

    @classmethod
    def build(cls, req: Request, draft: Draft | None) -> HybridProposer:
        return cls(DraftModelProposer.build(req, draft), cls.lookup_for(req.drafting))

    @staticmethod
    def lookup_for(d: Drafting) -> NgramProposer:
        """The n-gram lookup a hybrid run trusts: matches of at least d.hybrid_min_match tokens."""
        return NgramProposer(d.hybrid_min_match, max(d.ngram_max, d.hybrid_min_match))

    @property
    def generator(self) -> torch.Generator | None:
        return self.model.generator

    @generator.setter
    def generator(self, g: torch.Generator | None) -> None:
        self.model.generator = g  # the engine's seeded stream, as for a plain draft model

    def propose(self, ids: list[int], k: int, stop=None) -> Proposal:
        proposal = self.lookup.propose(ids, k)
        # the draft model catches up on the skipped tokens in one pass the next time it drafts
        return proposal if proposal.ids else self.model.propose(ids, k, stop)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
