"""Sampling parameters, logits warping, and verification of draft tokens.

Verification decides, for one speculation step, how many of the K draft tokens the target accepts and which token
the target adds itself (see engine.events for accepted / recovered / bonus):

- greedy (temperature 0): accept while each draft equals the target's argmax; the next token is the target's
  argmax at the first mismatch (recovered) or after the last draft (bonus). Output equals plain greedy decoding.
- sampled: the rejection sampler of Leviathan et al. (2023) / Chen et al. (2023). Accept draft x with probability
  min(1, p(x) / q(x)); at the first rejection sample from norm(max(0, p - q)); after K acceptances sample a bonus
  token from p. Every output token is then distributed exactly as the target's own sampling would be, provided p
  and q are warped identically (temperature, top-k, top-p), which `warp` guarantees by being the only warper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.limits import MAX_TEMPERATURE, SettingsError, check_range


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        check_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.top_k < 0:
            raise SettingsError(f"top-k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SettingsError(f"top-p must be in (0, 1], got {self.top_p}")


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p (in that order)."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the tokens ranked above it already reach top_p (the top token always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """Plain decoding from one position's logits [V]: (token, its probability under the warped distribution)."""
    if params.greedy:
        token = int(logits.argmax())
        return token, 1.0
    probs = warp(logits, params)
    token = sample(probs, generator)
    return token, float(probs[token])


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft_ids [K], target_logits [K+1, V] -> (number accepted, next token)."""
    K = draft_ids.shape[0]
    target_ids = target_logits.argmax(-1)  # [K+1]
    mismatch = (draft_ids != target_ids[:K]).nonzero()
    n = int(mismatch[0]) if len(mismatch) else K
    return n, int(target_ids[n])


def rejection_sample(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Sampled verification.

    draft_ids    [K]       the proposed tokens
    draft_probs  [K, V]    q, the warped draft distributions; None for a deterministic drafter (n-gram),
                           which is q = one-hot(draft)
    target_probs [K+1, V]  p, the warped target distributions; row K is for the bonus token
    returns (number accepted n, next token: recovered at position n if n < K, else bonus)
    """
    K = draft_ids.shape[0]
    rows = torch.arange(K)
    p_draft = target_probs[rows, draft_ids]  # [K]
    q_draft = draft_probs[rows, draft_ids] if draft_probs is not None else torch.ones(K)  # [K]
    u = torch.rand(K, generator=generator)
    # u < p/q, written without the division; q(x) > 0 because x was drawn from q
    rejected = (u * q_draft >= p_draft).nonzero()
    n = int(rejected[0]) if len(rejected) else K
    if n == K:
        return K, sample(target_probs[K], generator)
    if draft_probs is not None:
        residual = (target_probs[n] - draft_probs[n]).clamp_min(0)
    else:
        residual = target_probs[n].clone()
        residual[draft_ids[n]] = 0
    if residual.sum() <= 0:  # p == q: a rejection has probability 0, but guard against rounding
        residual = target_probs[n]
    return n, sample(residual / residual.sum(), generator)
