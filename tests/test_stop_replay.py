"""benchmarks.stop_replay: a replayed step must be the step the engine takes, and its modelled time the sum of its
parts."""

from functools import partial

import pytest

from benchmarks.stop_replay import Ours, Trace, floor_drafts, record, replay
from engine.exact.proposers import DraftModelProposer
from engine.exact.decode import generate_speculative
from engine.exact.policy import PolicyConfig, SpecPolicy
from engine.sampling_params import SamplingParams
from engine.stops import StopConditions

PROMPT = [5, 17, 99, 3, 250, 17, 99, 3, 41]


class Recorded:
    """A replay rule that notes each step's (drafted, accepted)."""

    def __init__(self, rule):
        self.rule, self.steps = rule, []

    def __call__(self, *args):
        return self.rule(*args)

    def observe(self, step):
        self.steps.append((step.drafted, step.accepted))


@pytest.fixture(scope="module")
def tiny_trace(tiny_pair, smol_tokenizer):
    target, draft = tiny_pair
    trace, ms = record(target, draft, smol_tokenizer, "tiny", PROMPT, 40)
    assert len(trace.output) == 40 and len(ms) >= 40
    return trace


@pytest.mark.parametrize("k", [2, 5])
def test_replayed_steps_are_the_engines(tiny_pair, smol_tokenizer, tiny_trace, k):
    """Fixed K with a confidence floor (HF's rule, with other numbers): the engine's own steps (drafted, accepted),
    replayed from the record."""
    target, draft = tiny_pair
    floor = 0.2
    proposer = DraftModelProposer(draft, target.config.vocab_size, SamplingParams(), None, confidence=floor)
    *_, run = generate_speculative(target, smol_tokenizer, proposer, PROMPT, SamplingParams(), StopConditions(40),
                                   SpecPolicy(PolicyConfig(k=k)))
    assert run.output_ids == tiny_trace.output
    engine = [(s.drafted, s.accepted) for s in run.steps]

    rule = Recorded(partial(floor_drafts, k=k, floor=floor))
    replay(tiny_trace, rule, {m: 1.0 for m in range(1, 22)}, 0.0)
    assert rule.steps == engine
    assert {a for _, a in rule.steps} > {0}  # some drafts were kept, some rejected at once


def test_the_record_ends_where_the_engine_stops(tiny_pair, smol_tokenizer, tiny_trace):
    """An end-of-sequence token ends the recorded output, as it ends the engine's (a run past it is another text)."""
    target, draft = tiny_pair
    eos = tiny_trace.output[12]
    trace, _ = record(target, draft, smol_tokenizer, "tiny", PROMPT, 40, frozenset({eos}))
    assert trace.output == tiny_trace.output[:tiny_trace.output.index(eos) + 1]
    assert len(trace.drafts) == len(trace.output)


def test_modelled_time_is_drafts_plus_verify_passes():
    # output 1..8; after each prefix the draft proposes the next two tokens right, then a wrong one it is unsure of
    output = list(range(1, 9))
    drafts = [output[i:i + 2] + [99] for i in range(len(output))]
    trace = Trace("hand", [0], output, drafts, [[0.9, 0.9, 0.1]] * len(output))
    curve = {1: 100.0, 2: 110.0, 3: 120.0, 4: 130.0}
    total, passes = replay(trace, floor_drafts, curve, draft_ms=10.0)
    # after the prompt and after 3: three drafts, two kept, 3 tokens; at 6 two tokens left: one draft, kept, and the
    # bonus. The prefill's pass (step 0) is left out of the time.
    assert passes == 3
    assert total == pytest.approx(3 * 10.0 + (3 * 10.0 + 130.0) + (10.0 + 110.0))


def test_ours_takes_fewer_passes_than_plain_decoding(tiny_trace):
    curve = {m: 100.0 + 5 * m for m in range(1, 22)}
    total, passes = replay(tiny_trace, Ours(curve, known=True), curve, draft_ms=5.0)
    cold_total, cold_passes = replay(tiny_trace, Ours(curve, known=False), curve, draft_ms=5.0)
    assert passes < len(tiny_trace.output) and cold_passes < len(tiny_trace.output)
    assert total > 0 and cold_total > 0
