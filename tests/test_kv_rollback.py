"""After a rejection, both KV caches must equal those of a fresh run on the committed prefix."""

import pytest
import torch

from engine.exact import proposers
from engine.exact.proposers import DraftModelProposer
from engine.exact.forward import forward, move_position, new_cache, rollback
from engine.exact.optimize import prepare_target
from engine.sampling_params import SamplingParams
from engine.exact.sampling import verify_greedy
from tests.conftest import CPU, tiny_llama

PROMPT = [5, 17, 99, 3, 250, 41, 7]


def assert_same_cache(cache, fresh):
    assert cache.get_seq_length() == fresh.get_seq_length()
    for a, b in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=1e-5)


def fresh_cache(model, ids):
    cache = new_cache(model)
    forward(model, ids, cache, keep=1)
    return cache


def test_target_cache_after_rejection(tiny_pair):
    target, _ = tiny_pair
    cache = new_cache(target)
    first = int(forward(target, PROMPT, cache, keep=1)[-1].argmax())
    ids = PROMPT + [first]
    # drafts that agree with the target twice, then go wrong
    truth = []
    probe = fresh_cache(target, ids[:-1])
    token = ids[-1]
    for _ in range(2):
        token = int(forward(target, [token], probe, keep=1)[-1].argmax())
        truth.append(token)
    drafts = truth + [(truth[-1] + 1) % 512, 7]
    logits = forward(target, [ids[-1]] + drafts, cache, keep=len(drafts) + 1)
    n, recovered = verify_greedy(torch.tensor(drafts), logits)
    assert n == 2
    rollback(cache, len(ids) + n)
    committed = ids + drafts[:n]  # the recovered token is fed at the next step, so it is not cached yet
    assert_same_cache(cache, fresh_cache(target, committed))
    # and decoding goes on exactly as a fresh run would
    after = forward(target, [recovered], cache, keep=1)
    fresh = forward(target, committed + [recovered], new_cache(target), keep=1)
    torch.testing.assert_close(after, fresh, rtol=0, atol=1e-5)


def test_draft_cache_rolls_back_and_never_reruns(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    proposer = DraftModelProposer(draft, 512, SamplingParams(), None)
    calls = []

    def counting_forward(model, ids, *args, **kwargs):  # the tokens each draft pass feeds
        calls.append(len(ids))
        return forward(model, ids, *args, **kwargs)

    monkeypatch.setattr(proposers, "forward", counting_forward)
    ids = PROMPT + [11]
    proposal = proposer.propose(ids, 4)
    assert calls == [len(ids), 1, 1, 1]  # prefill, then one token per further draft
    # the target keeps 2 drafts and adds its own token
    committed = ids + proposal.ids[:2] + [300]
    calls.clear()
    proposer.propose(committed, 3)
    assert calls[0] == 1  # only the new token: the kept drafts were already in the draft's cache
    calls.clear()
    proposer.update(committed)
    assert calls == []  # update only crops the cache: nothing runs
    monkeypatch.undo()
    assert proposer.cached == committed[: len(proposer.cached)]
    assert_same_cache(proposer.cache, fresh_cache(draft, proposer.cached))


def test_draft_cache_after_all_accepted(tiny_pair):
    _, draft = tiny_pair
    proposer = DraftModelProposer(draft, 512, SamplingParams(), None)
    ids = PROMPT + [11]
    proposal = proposer.propose(ids, 3)
    committed = ids + proposal.ids + [42]  # all accepted, then a bonus token
    proposer.update(committed)
    # the last draft was never fed, so the cache holds everything up to the second-to-last draft
    assert proposer.cached == ids + proposal.ids[:2]
    assert_same_cache(proposer.cache, fresh_cache(draft, proposer.cached))


@pytest.mark.parametrize("at", [1, 2])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["grouped-query", "multi-head"])
def test_token_tree_rows_and_cache(kv_heads, at):
    """A token tree (forward's `tree`): each alternative to the draft at pass row `at` holds, bitwise, the logits of
    plain steps with that alternative in the draft's place; the chain's rows are untouched; once accepted, its keys
    and values take that place in the cache, which then equals the plain steps' cache bitwise."""
    target = prepare_target(tiny_llama(512, seed=5, kv_heads=kv_heads), CPU)
    drafts, alternatives = [11, 12], [13, 14]
    for j, alt in enumerate(alternatives):
        plain = new_cache(target)
        last = int(forward(target, PROMPT, plain, keep=1)[-1].argmax())
        chain = [forward(target, [t], plain, keep=1)[-1] for t in [last] + drafts]  # one plain step per token
        rollback(plain, len(PROMPT) + at)  # back to just before the draft the alternatives stand in for
        after_alt = forward(target, [alt], plain, keep=1)[-1]

        cache = fresh_cache(target, PROMPT)
        logits = forward(target, [last] + drafts + alternatives, cache, keep=5, tree=len(alternatives), tree_at=at)
        assert all(torch.equal(logits[i], chain[i]) for i in range(len(drafts) + 1))
        assert torch.equal(logits[len(drafts) + 1 + j], after_alt)
        where = len(PROMPT) + at  # the position of the draft it replaces
        move_position(cache, len(PROMPT) + 1 + len(drafts) + j, where)
        rollback(cache, where + 1)
        assert cache.get_seq_length() == plain.get_seq_length()
        for a, b in zip(cache.layers, plain.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
