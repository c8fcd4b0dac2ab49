"""The K policy and the fallback, on constructed step records."""

import pytest

from engine.events import PolicyAction, StepRecord
from engine.exact.policy import Costs, DraftStop, PolicyConfig, SpecPolicy
from engine.limits import SettingsError
from engine.request import Request


def spec_step(drafted, accepted, draft_ms=10.0, verify_ms=110.0):
    return StepRecord(1, drafted, accepted, accepted + 1, draft_ms * drafted, verify_ms, 0.0)


def plain_step(ms=100.0):
    return StepRecord(1, 0, 0, 1, 0.0, ms, 0.0)


def iid(k, **kw):
    """Dynamic K from the i.i.d. acceptance model (no per-token stopping)."""
    return SpecPolicy(PolicyConfig(k=k, dynamic=True, per_token=False, **kw), target_step_ms=100.0)


def test_measures_a_plain_step_before_deciding():
    policy = SpecPolicy(PolicyConfig(k=4, dynamic=True))
    assert policy.next_k() == 0
    policy.observe(plain_step())
    assert policy.target_step_ms == 100.0 and policy.next_k() == 4


def test_step_0_is_no_cost_sample():
    """Step 0's pass reads the prompt: without drafts it is no plain step, with drafts no verify sample, and the
    fallback leaves it out."""
    policy = SpecPolicy(PolicyConfig(k=4, dynamic=True, fallback=True, fallback_window=2))
    policy.observe(StepRecord(0, 0, 0, 1, 0.0, 2000.0, 0.0))  # a long prompt's prefill
    assert policy.target_step_ms is None and policy.next_k() == 0
    policy.observe(plain_step())
    assert policy.target_step_ms == 100.0

    policy = SpecPolicy(PolicyConfig(k=4, fallback=True, fallback_window=2), target_step_ms=100.0)
    policy.observe(StepRecord(0, 4, 4, 5, 40.0, 2000.0, 0.0))  # 5 tokens, but after a 2 s prefill
    assert policy.verify_ms == {}
    decisions = policy.observe(spec_step(4, 4, verify_ms=110.0))  # 5 tokens in 150 ms: faster than plain steps
    assert policy.verify_ms == {5: 110.0}
    assert not any(d.action == PolicyAction.FALLBACK for d in decisions)


def test_dynamic_k_grows_when_everything_is_accepted():
    policy = iid(4, k_max=16)
    decisions = []
    for _ in range(8):
        decisions += policy.observe(spec_step(policy.current_k, policy.current_k, draft_ms=5.0, verify_ms=104.0))
    assert policy.current_k >= 12
    assert decisions and decisions[0].action == PolicyAction.K_CHANGE


def test_dynamic_k_shrinks_when_drafts_fail():
    policy = iid(8)
    for _ in range(8):
        policy.observe(spec_step(policy.current_k, 0))
    assert policy.current_k == 1


def test_k_follows_the_costs():
    """Same acceptance, dearer draft: a shorter K is best."""
    cheap = iid(4)
    dear = iid(4)
    for _ in range(8):
        cheap.observe(spec_step(4, 3, draft_ms=2.0))
        dear.observe(spec_step(4, 3, draft_ms=40.0))
    assert cheap.current_k > dear.current_k


def test_fallback_and_resume():
    policy = SpecPolicy(PolicyConfig(k=4, fallback=True, fallback_window=3, cooldown=2), target_step_ms=100.0)
    decisions = []
    for _ in range(3):  # 1 token per 150 ms is worse than 1 per 100 ms
        decisions += policy.observe(spec_step(4, 0, draft_ms=10.0, verify_ms=110.0))
    assert [d.action for d in decisions] == [PolicyAction.FALLBACK]
    assert "tok/s" in decisions[0].reason and decisions[0].action == "fallback"  # still the saved string
    assert policy.next_k() == 0
    assert policy.observe(plain_step()) == []
    assert [d.action for d in policy.observe(plain_step())] == [PolicyAction.RESUME]
    assert policy.next_k() == 4


def test_each_fallback_in_a_row_rests_twice_as_long():
    """Where speculation cannot pay, each new try costs fallback_window losing steps: the plain stretches between
    tries double (2, 4, 8, capped at max_cooldown), and a try that pays starts them short again."""
    policy = SpecPolicy(PolicyConfig(k=4, fallback=True, fallback_window=2, cooldown=2, max_cooldown=8),
                        target_step_ms=100.0)
    rests = []
    for _ in range(5):
        decisions = [d for _ in range(2) for d in policy.observe(spec_step(4, 0))]
        assert [d.action for d in decisions] == [PolicyAction.FALLBACK]
        plain = 0
        while policy.next_k() == 0:
            resumed = policy.observe(plain_step())
            plain += 1
        assert f"after {plain} plain steps" in resumed[0].reason
        rests.append(plain)
    assert rests == [2, 4, 8, 8, 8]
    for _ in range(2):
        assert policy.observe(spec_step(4, 4)) == []  # it pays now
    decisions = [d for _ in range(2) for d in policy.observe(spec_step(4, 0))]
    assert decisions[0].action == PolicyAction.FALLBACK and policy.plain_left == 2
    with pytest.raises(SettingsError, match="fallback's window"):
        PolicyConfig(window=4, fallback_window=5).validate()


def test_no_fallback_when_speculation_pays():
    policy = SpecPolicy(PolicyConfig(k=4, fallback=True, fallback_window=3), target_step_ms=100.0)
    for _ in range(10):
        assert policy.observe(spec_step(4, 4)) == []


def flat(ms):
    """A verify cost that does not grow with the tokens verified."""
    return lambda m: ms


def drafted_until_stop(confidences, token_ms, alpha=0.8, target_ms=100.0):
    stop = DraftStop(alpha, token_ms, flat(target_ms))
    for n, a in enumerate(confidences, 1):
        if not stop.more(a):
            return n
    return len(confidences)


def test_draft_stop_runs_through_sure_tokens_and_stops_at_a_doubt():
    assert drafted_until_stop([1.0] * 16, token_ms=2.0) == 16
    # even sure drafts end at some length: the next token is only alpha likely, and each one costs the same
    assert 10 <= drafted_until_stop([1.0] * 32, token_ms=20.0) < 32
    assert drafted_until_stop([1.0, 1.0, 1.0, 0.3, 1.0, 1.0], token_ms=20.0) == 4  # the doubtful token ends it


def test_draft_stop_follows_the_costs():
    confidences = [0.9] * 16
    assert drafted_until_stop(confidences, token_ms=2.0) > drafted_until_stop(confidences, token_ms=40.0) >= 1
    assert drafted_until_stop(confidences, 20.0, alpha=0.95) >= drafted_until_stop(confidences, 20.0, alpha=0.3)


def test_draft_stop_rule_by_hand():
    """After one draft at confidence 0.5: E = 1.5 tokens for 100 + 20 ms; one more adds 0.5 * 0.8 = 0.4 tokens
    for 20 ms: 1.9 / 140 > 1.5 / 120, so go on. At confidence 0.2: 1.36 / 140 < 1.2 / 120, so stop."""
    assert DraftStop(0.8, 20.0, flat(100.0)).more(0.5) is True
    assert DraftStop(0.8, 20.0, flat(100.0)).more(0.2) is False


def test_draft_stop_reads_the_measured_verify_cost_of_each_length():
    """A kernel that verifies 2 tokens (1 draft) slower than 3: a second draft token makes the step cheaper, so the
    rule drafts it even after a token worth nothing (0: below the draft's confidence floor); then it stops."""
    curve = {2: 320.0, 3: 260.0, 4: 262.0}.get
    stop = DraftStop(0.5, 30.0, curve)
    assert stop.more(0.0) is True  # 1 token for 30 + 320 ms, or 1 token for 60 + 260 ms
    assert stop.more(0.9) is False  # nothing can follow a token worth nothing: one more only costs
    linear = DraftStop(0.5, 30.0, lambda m: 280.0 + 10 * (m - 1))
    assert linear.more(0.0) is False  # where longer passes cost more, an unsure token ends the draft


def test_policy_learns_the_verify_cost_per_length_and_shares_it():
    shared = {}
    policy = SpecPolicy(PolicyConfig(k=4, dynamic=True, k_max=16), target_step_ms=100.0, verify_ms=shared)
    assert policy.verify_cost(3) == 100.0  # nothing measured: one plain step (+ beta * 2, beta unknown yet)
    policy.observe(spec_step(2, 1, verify_ms=150.0))  # the first step also prefilled the draft: not a cost sample
    policy.observe(spec_step(2, 1, verify_ms=90.0))
    policy.observe(spec_step(4, 1, verify_ms=140.0))
    assert shared == {3: 90.0, 5: 140.0} and policy.verify_cost(3) == 90.0
    beta = policy.verify_ms_per_token
    assert policy.verify_cost(2) == 100.0 + beta  # unseen: the linear estimate from a plain step
    # ... or from the longest shorter pass measured
    assert policy.verify_cost(4) == 90.0 + beta and policy.verify_cost(7) == 140.0 + 2 * beta
    later = SpecPolicy(PolicyConfig(k=4, dynamic=True, k_max=16), target_step_ms=100.0, verify_ms=shared)
    assert later.verify_cost(5) == 140.0  # the next run starts from what this one measured
    linear = SpecPolicy(PolicyConfig(k=4, dynamic=True, verify_curve=False), target_step_ms=100.0, verify_ms=shared)
    assert linear.verify_cost(5) == 100.0  # the curve off: one plain step + beta * 4 (beta not measured in this run)


def test_per_token_policy_drafts_up_to_k_max_once_costs_are_known():
    policy = SpecPolicy(PolicyConfig(k=4, dynamic=True, k_max=16, per_token=True), target_step_ms=100.0)
    assert policy.draft_stop() is None and policy.next_k() == 4  # no draft cost measured yet
    decisions = []
    for _ in range(3):
        decisions += policy.observe(spec_step(4, 2, draft_ms=20.0, verify_ms=110.0))
    assert policy.draft_stop() is not None and policy.current_k == 16
    assert policy.next_k() == 6  # the cap: the recent drafts got 2 tokens accepted, so at most 2 * (2 + 1)
    # one recorded decision when the rule takes over; after that the rule, not K, decides each step's length
    assert [(d.action, d.k) for d in decisions] == [(PolicyAction.K_CHANGE, 16)] and "per-token" in decisions[0].reason


def test_config_is_fixed_and_the_running_k_is_state():
    config = PolicyConfig(k=8, dynamic=True, per_token=False)
    policy = SpecPolicy(config, target_step_ms=100.0)
    for _ in range(8):
        policy.observe(spec_step(policy.current_k, 0))
    assert policy.current_k == 1 and config.k == 8  # the user's K is untouched
    assert Request(prompt="x").drafting.per_token == PolicyConfig().per_token  # one default for both


def test_draft_cap_follows_where_recent_drafts_were_rejected():
    policy = SpecPolicy(PolicyConfig(k=4, dynamic=True, k_max=16), target_step_ms=100.0)  # per-token stopping
    assert policy.draft_cap() == 16  # nothing seen yet
    for _ in range(3):
        policy.observe(spec_step(4, 4, draft_ms=20.0))
    assert policy.current_k == 16 and policy.next_k() == 10  # 4 accepted in a row: up to 2 * (4 + 1)
    for _ in range(4):  # confidently wrong: long drafts, nothing accepted
        policy.observe(spec_step(policy.next_k(), 0, draft_ms=20.0))
    assert policy.next_k() == 2  # a fifth wrong draft wastes 2 tokens, not 14
    policy.observe(spec_step(2, 2, draft_ms=20.0))
    assert policy.next_k() == 6  # a full acceptance lets the drafts grow again
    for _ in range(3):
        policy.observe(spec_step(policy.next_k(), policy.next_k(), draft_ms=20.0))
    assert policy.next_k() == 16


def test_draft_cap_leaves_a_fixed_k_alone_and_can_be_switched_off():
    fixed = SpecPolicy(PolicyConfig(k=8, k_max=8), target_step_ms=100.0)
    off = SpecPolicy(PolicyConfig(k=4, dynamic=True, k_max=16, cap_steps=0), target_step_ms=100.0)
    for _ in range(4):
        fixed.observe(spec_step(8, 0))
        off.observe(spec_step(4, 2, draft_ms=20.0))
    assert fixed.next_k() == 8  # the user's K
    assert off.next_k() == 16  # the per-token rule's ceiling alone



def plan(policy: SpecPolicy, slower: float, accepted: list[int]) -> list:
    """Drive a policy through a fixed sequence of accepted lengths, its speculative steps timed `slower` times the
    calibrated costs and its plain steps as calibrated (a disturbance that lands on some passes and not on others),
    with what DraftStop decides for fixed draft confidences: what it planned, step by step."""
    decisions = []
    for i, a in enumerate(accepted):
        k = policy.next_k()
        stop = policy.draft_stop()
        if stop is not None:  # the draft's own confidences: sure, then less sure
            n = 0
            while n < k and stop.more(0.9 if n < 3 else 0.3):
                n += 1
            k = min(k, n + 1)
        decisions.append(k)
        if k == 0:
            step = StepRecord(i + 1, 0, 0, 1, 0.0, 100.0, 0.0)
        else:
            a = min(a, k)
            step = StepRecord(i + 1, k, a, a + 1, 10.0 * k * slower, (100.0 + 12.5 * k) * slower, 0.0, "draft")
        decisions += [(e.action, e.k) for e in policy.observe(step)]
    return decisions


def test_with_a_calibration_a_10_percent_slower_pass_does_not_change_the_plan():
    """The plan reads the calibration's costs, not the run's timings: speculative passes 10 % slower (the page
    drawing, a busier machine) make the same decisions, for the fallback, for K from the i.i.d. model and for the
    per-token stop. Without a calibration the same slowdown changes the plan: K = 4 with one draft accepted per step
    gives 2 tokens in 190 ms against a plain step's 100 ms, just ahead; 10 % slower, just behind."""
    costs = Costs(100.0, {m: 100.0 + 12.5 * (m - 1) for m in range(1, 18)}, 10.0)
    edge, mixed = [1] * 12, [3, 0, 4, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 2, 3, 1, 0, 2] * 2
    fixed = PolicyConfig(k=4, fallback=True)
    for config, accepted in ((fixed, edge), (PolicyConfig(k=4, dynamic=True, per_token=False, fallback=True), mixed),
                             (PolicyConfig(k=16, dynamic=True, per_token=True, fallback=True), mixed)):
        plans = [plan(SpecPolicy(config, costs=costs), slower, accepted) for slower in (1.0, 1.1)]
        assert plans[0] == plans[1], config
    learned = [plan(SpecPolicy(fixed, target_step_ms=100.0), slower, edge) for slower in (1.0, 1.1)]
    assert (PolicyAction.FALLBACK, 0) not in learned[0] and (PolicyAction.FALLBACK, 0) in learned[1]
