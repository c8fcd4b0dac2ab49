"""The K policy and the fallback, on constructed step records."""

from engine.events import StepRecord
from engine.policy import SpecPolicy


def spec_step(drafted, accepted, draft_ms=10.0, verify_ms=110.0):
    return StepRecord(1, drafted, accepted, accepted + 1, draft_ms * drafted, verify_ms, 0.0)


def plain_step(ms=100.0):
    return StepRecord(1, 0, 0, 1, 0.0, ms, 0.0)


def test_measures_a_plain_step_before_deciding():
    policy = SpecPolicy(k=4, dynamic=True)
    assert policy.next_k() == 0
    policy.observe(plain_step())
    assert policy.target_step_ms == 100.0 and policy.next_k() == 4


def test_dynamic_k_grows_when_everything_is_accepted():
    policy = SpecPolicy(k=4, dynamic=True, k_max=16, target_step_ms=100.0)
    decisions = []
    for _ in range(8):
        decisions += policy.observe(spec_step(policy.k, policy.k, draft_ms=5.0, verify_ms=104.0))
    assert policy.k >= 12
    assert decisions and decisions[0][0] == "k_change"


def test_dynamic_k_shrinks_when_drafts_fail():
    policy = SpecPolicy(k=8, dynamic=True, target_step_ms=100.0)
    for _ in range(8):
        policy.observe(spec_step(policy.k, 0))
    assert policy.k == 1


def test_k_follows_the_costs():
    """Same acceptance, dearer draft: a shorter K is best."""
    cheap = SpecPolicy(k=4, dynamic=True, target_step_ms=100.0)
    dear = SpecPolicy(k=4, dynamic=True, target_step_ms=100.0)
    for _ in range(8):
        cheap.observe(spec_step(4, 3, draft_ms=2.0))
        dear.observe(spec_step(4, 3, draft_ms=40.0))
    assert cheap.k > dear.k


def test_fallback_and_resume():
    policy = SpecPolicy(k=4, fallback=True, window=3, cooldown=2, target_step_ms=100.0)
    decisions = []
    for _ in range(3):  # 1 token per 150 ms is worse than 1 per 100 ms
        decisions += policy.observe(spec_step(4, 0, draft_ms=10.0, verify_ms=110.0))
    assert [d[0] for d in decisions] == ["fallback"]
    assert "tok/s" in decisions[0][2]
    assert policy.next_k() == 0
    assert policy.observe(plain_step()) == []
    assert [d[0] for d in policy.observe(plain_step())] == ["resume"]
    assert policy.next_k() == 4


def test_no_fallback_when_speculation_pays():
    policy = SpecPolicy(k=4, fallback=True, window=3, target_step_ms=100.0)
    for _ in range(10):
        assert policy.observe(spec_step(4, 4)) == []
