"""Prompt lookup proposes the continuation of the latest earlier match of the longest n-gram it can find."""

import pytest

from engine.exact.proposers import HybridProposer, NgramProposer, Proposal


def test_longest_then_latest_match():
    ids = [1, 2, 3, 9, 1, 2, 3, 8, 7, 5, 2, 3]
    # the tail [2, 3] occurs at 1 and 5; the latest (5) is followed by 8, 7, 5
    assert NgramProposer(1, 3).propose(ids, 3).ids == [8, 7, 5]
    # a longer n-gram wins over a later shorter one: [7, 3, 4] matches at 0, [3, 4] alone latest at 6
    ids = [7, 3, 4, 5, 0, 9, 3, 4, 6, 0, 7, 3, 4]
    assert NgramProposer(1, 3).propose(ids, 3).ids == [5, 0, 9]
    assert NgramProposer(1, 2).propose(ids, 3).ids == [6, 0, 7]


def test_proposal_is_cut_at_k_and_at_the_end():
    ids = [4, 5, 6, 4, 5]
    assert NgramProposer(1, 2).propose(ids, 10).ids == [6, 4, 5]
    assert NgramProposer(1, 2).propose(ids, 1).ids == [6]


def test_no_match_means_no_draft():
    proposal = NgramProposer(2, 3).propose([1, 2, 3, 4], 4)
    assert proposal.ids == [] and proposal.probs is None


def test_bad_sizes():
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


class _Model:
    """Stands in for a DraftModelProposer: records its calls and drafts 0s."""

    generator = None

    def __init__(self):
        self.calls = []

    def propose(self, ids, k, stop=None):
        self.calls.append((len(ids), k, stop))
        return Proposal([0] * k, None, "draft")

    def update(self, ids):
        pass


def test_hybrid_looks_up_long_matches_and_drafts_elsewhere():
    model = _Model()
    hybrid = HybridProposer(model, NgramProposer(3, 4))
    copying = [1, 2, 3, 4, 5, 6, 9, 2, 3, 4]  # the tail [2, 3, 4] occurred before: the text is copying
    proposal = hybrid.propose(copying, 2, stop="rule")
    assert (proposal.ids, proposal.drafter, model.calls) == ([5, 6], "ngram", [])
    short = [1, 2, 3, 4, 5, 6, 9, 3, 4]  # only [3, 4] repeats: too weak a match, the draft model drafts
    proposal = hybrid.propose(short, 2, stop="rule")
    assert (proposal.ids, proposal.drafter, model.calls) == ([0, 0], "draft", [(9, 2, "rule")])
    hybrid.generator = "g"  # the engine hands its seeded generator to the draft model
    assert model.generator == "g"
