"""Metrics recomputed by hand on a scripted run."""

from dataclasses import FrozenInstanceError, replace

import json

import pytest

from engine.comparison import ComparisonFigures
from engine.events import PolicyEvent, RunResult, StepRecord, TokenEvent, TokenKind
from engine.metrics import (
    acceptance_alpha, compare, expected_tokens_per_pass, first_divergence, run_metrics, speedup_bound,
)

A, R, REC, B, BASE = TokenKind.ACCEPTED, TokenKind.REJECTED, TokenKind.RECOVERED, TokenKind.BONUS, TokenKind.BASELINE


def scripted_speculative() -> RunResult:
    """Prefill (1 token) + 3 steps with K=4: accept 4 (+bonus), accept 1 (+recovered), accept 0 (+recovered)."""
    r = RunResult("speculative", "draft", prompt_tokens=10)
    toks = [(BASE, 0, 0, 0.10)]
    toks += [(A, 1, i, 0.30) for i in range(4)] + [(B, 1, 4, 0.30)]
    toks += [(A, 2, 0, 0.50), (R, 2, 1, 0.50), (R, 2, 2, 0.50), (R, 2, 3, 0.50), (REC, 2, 1, 0.50)]
    toks += [(R, 3, 0, 0.70), (R, 3, 1, 0.70), (R, 3, 2, 0.70), (R, 3, 3, 0.70), (REC, 3, 0, 0.70)]
    index = 0
    for kind, step, pos, t in toks:
        out = kind != R
        r.tokens.append(TokenEvent(kind, 100 + index, "x", step, pos, t, index if out else None))
        index += out
    r.steps = [
        StepRecord(0, 0, 0, 1, 0.0, 100.0, 0.10),
        StepRecord(1, 4, 4, 5, 40.0, 160.0, 0.30),
        StepRecord(2, 4, 1, 2, 40.0, 160.0, 0.50),
        StepRecord(3, 4, 0, 1, 40.0, 160.0, 0.70),
    ]
    r.policy = [PolicyEvent(3, "fallback", 0, "test", 0.7)]
    r.output_ids = [t.token_id for t in r.output_tokens]
    r.prefill_ms, r.total_s = 100.0, 0.8
    return r


def scripted_baseline(n=9, step_ms=100.0, dt=0.1) -> RunResult:
    r = RunResult("baseline", "none", prompt_tokens=10)
    for i in range(n):
        r.tokens.append(TokenEvent(BASE, 100 + i, "x", i, 0, dt * (i + 1), i))
        r.steps.append(StepRecord(i, 0, 0, 1, 0.0, step_ms, dt * (i + 1)))
    r.output_ids = [t.token_id for t in r.tokens]
    r.total_s = dt * n + 0.05
    return r


def test_run_metrics_by_hand():
    m = run_metrics(scripted_speculative())
    assert m.output_tokens == 9  # 1 + 5 + 2 + 1
    assert m.target_passes == 4 and m.baseline_passes == 9 and m.passes_saved == 5
    assert m.drafted == 12 and m.accepted == 5
    assert m.acceptance_rate == pytest.approx(5 / 12)
    # position 0 accepted in steps 1 and 2 of 3; positions 1..3 only in step 1
    assert m.per_position_acceptance == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert m.mean_accepted_length == pytest.approx(1 + 5 / 3)
    assert m.ttft_ms == pytest.approx(100.0)
    assert m.tpot_ms == pytest.approx(1000 * (0.70 - 0.10) / 8)
    assert m.tokens_per_s == pytest.approx(9 / 0.8)
    assert m.draft_ms_per_token == pytest.approx(120 / 12)
    assert m.verify_ms_mean == pytest.approx(160.0)
    assert m.fallback_count == 1 and m.rejected_tokens == 7


def test_histogram_ignored_drafts_and_the_time_split_by_hand():
    """The scripted run's steps accepted 4, 1 and 0 of 4 drafts; its steps carry no ignored counts (a server), then
    a planted stop that cut the last step after 2 of its drafts leaves the other 2 ignored."""
    r = scripted_speculative()
    m = run_metrics(r)
    assert m.acceptance_histogram == [1, 1, 0, 0, 1]  # one step each accepted 0, 1 and 4
    assert m.steps_accepting_nothing == pytest.approx(1 / 3)
    assert m.ignored_drafts is None  # the steps do not say: unknown, not 0
    # drafting 3 x 40 ms, passes 100 + 3 x 160 ms, in a run of 800 ms
    assert (m.drafting_ms, m.verifying_ms, m.other_ms) == pytest.approx((120.0, 580.0, 100.0))
    r.steps = [replace(s, ignored=0) for s in r.steps]
    r.steps[-1] = replace(r.steps[-1], accepted=2, emitted=2, ignored=2)
    m = run_metrics(r)
    assert m.ignored_drafts == 2 and m.acceptance_histogram == [0, 1, 1, 0, 1]
    assert m.steps_accepting_nothing == 0
    # a server's steps carry no timings: the split is unknown, not all "other"
    r.steps = [replace(s, draft_ms=0.0, verify_ms=0.0) for s in r.steps]
    assert run_metrics(r).drafting_ms is run_metrics(r).other_ms is None
    assert run_metrics(scripted_baseline()).acceptance_histogram == []


def test_a_speculative_engine_that_drafts_nothing_says_so():
    """Its first IDLE_CHECK_PASSES passes drafted nothing (speculation off): idle; with one draft among them, or
    fewer passes known, or the baseline: not."""
    from engine.metrics import IDLE_CHECK_PASSES, speculation_idle

    idle = scripted_baseline(IDLE_CHECK_PASSES)
    assert not speculation_idle(idle)  # the baseline drafts nothing by design
    idle.engine = "speculative"
    assert speculation_idle(idle)
    assert not speculation_idle(replace(idle, steps=idle.steps[:-1]))  # too early to tell
    idle.steps[3] = replace(idle.steps[3], drafted=2)
    assert not speculation_idle(idle)


def test_step_0_with_drafts():
    """Step 0 read the prompt and kept 2 of 3 drafts: its drafts count for acceptance, its time for no decoding
    cost, and its 3 tokens for no decoding time."""
    r = RunResult("speculative", "draft", prompt_tokens=10)
    toks = [(A, 0, 0, 1.0), (A, 0, 1, 1.0), (R, 0, 2, 1.0), (REC, 0, 2, 1.0), (A, 1, 0, 1.2), (B, 1, 1, 1.2)]
    index = 0
    for kind, step, pos, t in toks:
        out = kind != R
        r.tokens.append(TokenEvent(kind, 100 + index, "x", step, pos, t, index if out else None))
        index += out
    r.steps = [StepRecord(0, 3, 2, 3, 90.0, 900.0, 1.0), StepRecord(1, 1, 1, 2, 30.0, 170.0, 1.2)]
    r.prefill_ms, r.total_s = 900.0, 1.2
    m = run_metrics(r)
    assert m.drafted == 4 and m.accepted == 3 and m.steps == 2
    assert m.draft_ms_per_token == pytest.approx(30.0) and m.verify_ms_mean == pytest.approx(170.0)
    assert m.decode_tokens_per_s == pytest.approx(2 / 0.2)  # tokens 4-5 in the 0.2 s after step 0
    assert m.ttft_ms == pytest.approx(1000.0)


def test_theory():
    assert expected_tokens_per_pass(0.0, 4) == 1
    assert expected_tokens_per_pass(1.0, 4) == 5
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    # Leviathan et al., eq. 1 with c = 0.1, K = 4, alpha = 0.8
    e = (1 - 0.8**5) / 0.2
    assert speedup_bound(0.8, 4, 0.1) == pytest.approx(e / 1.4)
    assert speedup_bound(0.8, 4, 0.1, v=1.6) == pytest.approx(e / 2.0)


def test_compare_by_hand():
    s, b = scripted_speculative(), scripted_baseline()
    s.metrics, b.metrics = run_metrics(s), run_metrics(b)
    c = compare(b, s, greedy=True)
    assert c.speedup == pytest.approx((9 / 0.8) / (9 / 0.95))
    alpha = (5 + 1) / (5 + 2 + 2)  # 5 accepted, 2 steps ended by a rejection
    assert acceptance_alpha(s.steps[1:]) == pytest.approx(alpha)
    assert c.alpha == pytest.approx(alpha)
    assert c.draft_cost_ratio == pytest.approx(0.1)  # 10 ms per draft token / 100 ms per target step
    e = expected_tokens_per_pass(alpha, 4)
    assert c.theoretical_bound == pytest.approx(e / 1.4)
    assert c.machine_bound == pytest.approx(e / (0.4 + 1.6))
    assert c.efficiency == pytest.approx(c.decode_speedup / c.machine_bound)
    assert c.identical is True and c.first_divergence is None
    with pytest.raises(FrozenInstanceError):
        c.speedup = 2.0


def test_comparisons_saved_by_older_versions_read_into_their_type():
    """The history's comparison column holds the figures beside the machine's load and the sampling check; older
    versions left out the figures they did not know or did not compute. They read into ComparisonFigures, unknown
    where missing, and a saved one reads back equal."""
    s, b = scripted_speculative(), scripted_baseline()
    s.metrics, b.metrics = run_metrics(s), run_metrics(b)
    c = compare(b, s, greedy=True)
    saved = json.loads(json.dumps(c.to_dict() | {"noisy": False, "sampling_check": None}))
    assert ComparisonFigures.from_dict(saved) == c
    old = {"speedup": 1.3, "identical": False, "first_divergence": 4, "noisy": True}  # no bounds, no near-tie
    assert ComparisonFigures.from_dict(old) == ComparisonFigures(speedup=1.3, identical=False, first_divergence=4)
    assert ComparisonFigures.from_dict(None) == ComparisonFigures.from_dict([1]) == ComparisonFigures()
    sampled = compare(b, s, greedy=False)
    assert sampled.identical is None and sampled.first_divergence is None and sampled.speedup == c.speedup


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_metrics_saved_by_older_versions_read_into_their_type():
    """A history file keeps metrics as JSON; older versions saved a server's own figures under prefixed names and
    the vLLM counters untyped. They read into RunMetrics, and a saved RunMetrics reads back equal."""
    from engine.run_metrics import RunMetrics, ServerCounters

    m = run_metrics(scripted_speculative())
    assert RunMetrics.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    old = {"output_tokens": 9, "acceptance_rate": 0.5, "vllm_time_to_first_token_ms": 12.5,
           "vllm_completion_tokens": 9, "llamacpp_drafted": 8, "a_figure_since_dropped": "x",
           "server_delta": {"num_drafts": 3.0, "num_draft_tokens": 12.0, "num_accepted_tokens": 5.0},
           "server_per_position_acceptance": [0.5, 0.25]}
    m = RunMetrics.from_dict(old)
    assert (m.output_tokens, m.acceptance_rate) == (9, 0.5)
    assert m.server == {"time_to_first_token_ms": 12.5, "completion_tokens": 9, "drafted": 8}
    assert m.server_counters == ServerCounters(3.0, 12.0, 5.0, [0.5, 0.25])
    assert RunMetrics.from_dict(None) == RunMetrics()
