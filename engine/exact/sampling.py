"""Logits warping and verification of draft tokens (SamplingParams, torch-free, is in engine.sampling_params).

In one speculation step the proposer drafts K tokens and the target scores them all in one forward pass. The terms
(every engine, engine.events.TokenKind and the page use them):

    accepted tokens   drafts the target keeps: a prefix of the K drafts (with a token tree, engine.exact.tree, one of the
                      draft's alternatives may take the place of the first refused draft).
    rejected tokens   the first draft the target refuses and every draft after it; never part of the output.
    recovered token   the target's own token at the first rejected position.
    bonus token       the target's own token after the accepted ones when none was refused (all K drafts, or a
                      tree's alternative, accepted).
    output tokens     the accepted tokens, then the recovered or bonus token: a step commits between 1 and K+1.
    ignored drafts    drafts whose position the output never reached, because a stop (a stop string, EOS, the
                      token limit) ended the run earlier in the step: neither accepted nor rejected, though they
                      were drafted and verified. Every draft is accepted, rejected or ignored.

Verification decides them, from the target's distribution p and the draft's q (each [V] per position):

- greedy (temperature 0): accept while each draft equals the target's argmax; the recovered or bonus token is the
  target's argmax there. Output equals plain greedy decoding.
- sampled: the rejection sampler of Leviathan et al. (2023) / Chen et al. (2023). Accept draft x with probability
  min(1, p(x) / q(x)); sample the recovered token from norm(max(0, p - q)), the bonus token from p. Every output
  token is then distributed exactly as the target's own sampling would be, provided p and q are warped identically
  (temperature, top-k, top-p), which `warp` guarantees by being the only warper.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


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


def runners_up(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """logits [R, V] -> per row the second most likely token and the margin: how far the best token's logit is above
    it. The near-tie evidence where two greedy outputs part: a pass of another shape can round a small margin the
    other way. Logits, not probabilities: no pass over the vocabulary's exponentials for every token (about 1 % of a
    decoding step here), and the probability margin p(best) - p(second) = p(best) (1 - exp(-margin)) is at most
    the margin."""
    values, indices = logits.topk(2, dim=-1)
    return indices[:, 1].tolist(), (values[:, 0].float() - values[:, 1].float()).tolist()


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
    draft_probs  [K, V]    q, the warped draft distributions; None for a deterministic proposer (n-gram),
                           which is q = one-hot(draft)
    target_probs [K+1, V]  p, the warped target distributions; row K is for the bonus token
    returns (number accepted n, next token: recovered at position n if n < K, else bonus)
    """
    K = draft_ids.shape[0]
    rows = torch.arange(K)
    p_draft = target_probs[rows, draft_ids]  # [K]
    q_draft = draft_probs[rows, draft_ids] if draft_probs is not None else torch.ones(K)  # [K]
    u = torch.rand(K, generator=generator)  # [K]
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
