"""Prompt lookup proposes the continuation of the latest earlier match of the longest n-gram it can find."""

import pytest

from engine.drafters import NgramProposer


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
