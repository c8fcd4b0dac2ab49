"""Greedy speculative decoding must equal plain greedy decoding token for token."""

import pytest
import torch

from engine.exact.proposers import DraftModelProposer, HybridProposer, NgramProposer, Proposal
from engine.events import RunResult, TokenKind
from engine.exact.forward import forward, new_cache
from engine.exact.decode import generate_baseline, generate_speculative
from engine.exact.policy import PolicyConfig, SpecPolicy
from engine.sampling_params import SamplingParams
from engine.stops import StopConditions

GREEDY = SamplingParams()
PROMPT = [5, 17, 99, 3, 250, 17, 99, 3, 41]  # repeats, so that n-gram lookup has something to find


def last(events) -> RunResult:
    *_, result = events
    assert isinstance(result, RunResult)
    return result


def baseline(model, tok, prompt, stops):
    return last(generate_baseline(model, tok, prompt, GREEDY, stops))


def speculative(model, tok, proposer, prompt, stops, policy):
    return last(generate_speculative(model, tok, proposer, prompt, GREEDY, stops, policy))


def fixed(k):
    return SpecPolicy(PolicyConfig(k=k))


def draft_proposer(draft, target):
    return DraftModelProposer(draft, target.config.vocab_size, GREEDY, None)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_draft_model_fixed_k(tiny_pair, smol_tokenizer, k):
    target, draft = tiny_pair
    stops = StopConditions(60)
    b = baseline(target, smol_tokenizer, PROMPT, stops)
    s = speculative(target, smol_tokenizer, draft_proposer(draft, target), PROMPT, stops, fixed(k))
    assert s.output_ids == b.output_ids
    assert len(s.output_ids) == 60 and s.finish_reason == "length"
    kinds = {t.kind for t in s.tokens}
    # the draft is right only part of the time: every kind of token must have occurred
    assert {TokenKind.ACCEPTED, TokenKind.REJECTED, TokenKind.RECOVERED} <= kinds
    assert s.metrics.target_passes < b.metrics.target_passes == 60


def test_dynamic_k_and_fallback(tiny_pair, smol_tokenizer):
    target, draft = tiny_pair
    stops = StopConditions(80)
    b = baseline(target, smol_tokenizer, PROMPT, stops)
    policy = SpecPolicy(PolicyConfig(k=2, dynamic=True, k_max=12, per_token=False, fallback=True))
    s = speculative(target, smol_tokenizer, draft_proposer(draft, target), PROMPT, stops, policy)
    assert s.output_ids == b.output_ids
    assert s.steps[1].drafted == 0  # one plain step measured the target's cost before any decision
    assert len({st.drafted for st in s.steps if st.drafted}) >= 1


def test_per_token_draft_stop(tiny_pair, smol_tokenizer):
    """The draft stops by its own confidence (policy.DraftStop): step lengths vary, the output does not."""
    target, draft = tiny_pair
    stops = StopConditions(80)
    b = baseline(target, smol_tokenizer, PROMPT, stops)
    # a (pretend) dear target step makes drafting look cheap, so that the draft's confidence decides the length
    policy = SpecPolicy(PolicyConfig(k=2, dynamic=True, k_max=12, per_token=True), target_step_ms=1000.0)
    s = speculative(target, smol_tokenizer, draft_proposer(draft, target), PROMPT, stops, policy)
    assert s.output_ids == b.output_ids
    assert policy.draft_stop() is not None  # the costs were measured, so the rule was in charge
    lengths = {st.drafted for st in s.steps[3:] if st.drafted}
    assert len(lengths) > 1 and max(lengths) <= 12


@pytest.mark.parametrize("per_token", [False, True], ids=["fixed-k", "per-token-stop"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_token_tree(tiny_pair, smol_tokenizer, k, per_token):
    """Passes of fewer than 5 rows also verify the draft's next-best tokens where it was least sure (with a fixed K
    it has no confidences: the first position). The output stays the baseline's, and a step whose alternative is
    the target's token accepts the chain up to there, refuses the rest, accepts the alternative in its place and
    adds the target's next token as the bonus."""
    target, draft = tiny_pair
    stops = StopConditions(60)
    b = baseline(target, smol_tokenizer, PROMPT, stops)
    proposer = DraftModelProposer(draft, target.config.vocab_size, GREEDY, None, alternatives=3)
    # per-token: a (pretend) dear target step makes the draft's confidence decide the length, up to k
    policy = SpecPolicy(PolicyConfig(k=k, dynamic=True, k_max=k), target_step_ms=1000.0) if per_token else fixed(k)
    s = last(generate_speculative(target, smol_tokenizer, proposer, PROMPT, GREEDY, stops, policy, tree_rows=5))
    assert s.output_ids == b.output_ids
    events = {st.step: [(t.kind, t.position) for t in s.tokens if t.step == st.step] for st in s.steps}
    won = [st for st in s.steps if any((TokenKind.ACCEPTED, p) in events[st.step]
                                       for kind, p in events[st.step] if kind == TokenKind.REJECTED)]
    assert won and len(won) == s.metrics.tree_accepted
    for st in won:
        at = st.accepted - 1  # the alternative's position
        expected = ([(TokenKind.ACCEPTED, i) for i in range(at)]
                    + [(TokenKind.REJECTED, i) for i in range(at, st.drafted)]
                    + [(TokenKind.ACCEPTED, at), (TokenKind.BONUS, at + 1)])
        assert events[st.step] == expected[: len(events[st.step])]


class ScriptedDrafter:
    """Drafts from a known answer: the right token, then a wrong one, with the right one among the alternatives for
    the second position. Every step must then accept the first draft, refuse the second, accept the alternative in
    its place and add the bonus."""

    method = "draft"

    def __init__(self, prompt, answer):
        self.prompt, self.answer = prompt, answer

    def propose(self, ids, k, stop=None):
        i = len(ids) - len(self.prompt)
        right = self.answer[i : i + 2]
        wrong = [(t + 1) % 512 for t in right]
        return Proposal([right[0], wrong[1]], None, self.method, alternatives=[wrong[1] + 1, right[1]], branch_at=1)

    def update(self, ids):
        pass


def test_token_tree_branch_after_accepted_drafts(tiny_pair, smol_tokenizer):
    target, _ = tiny_pair
    b = baseline(target, smol_tokenizer, PROMPT, StopConditions(32))
    s = last(generate_speculative(target, smol_tokenizer, ScriptedDrafter(PROMPT, b.output_ids + [0, 0]), PROMPT,
                                  GREEDY, StopConditions(32), fixed(2), tree_rows=5))
    assert s.output_ids == b.output_ids
    later = s.steps[1:-1]  # step 0 reads the prompt (no tree); the last may be cut short by the token limit
    assert later and all(st.drafted == 2 and st.accepted == 2 and st.emitted == 3 for st in later)
    assert s.metrics.tree_accepted == len(s.steps) - 1
    kinds = [(t.kind, t.position) for t in s.tokens if t.step == 1]
    assert kinds == [(TokenKind.ACCEPTED, 0), (TokenKind.REJECTED, 1), (TokenKind.ACCEPTED, 1), (TokenKind.BONUS, 2)]


@pytest.mark.parametrize("k", [2, 5])
def test_ngram(tiny_pair, smol_tokenizer, k):
    target, _ = tiny_pair
    stops = StopConditions(60)
    b = baseline(target, smol_tokenizer, PROMPT, stops)
    s = speculative(target, smol_tokenizer, NgramProposer(1, 3), PROMPT, stops, fixed(k))
    assert s.output_ids == b.output_ids
    assert s.metrics.drafted > 0


@pytest.mark.parametrize("min_match,dynamic", [(2, False), (1, True)])
def test_hybrid(tiny_pair, smol_tokenizer, min_match, dynamic):
    """n-gram lookup where it matches, the draft model elsewhere: both take turns, the output stays the baseline's.
    (The tiny random model's text rarely repeats 3 tokens, the default match; real weights test that one.)"""
    target, draft = tiny_pair
    stops = StopConditions(80)
    b = baseline(target, smol_tokenizer, PROMPT, stops)
    proposer = HybridProposer(draft_proposer(draft, target), NgramProposer(min_match, 4))
    # dynamic: per-token stopping for the draft model's steps, the draft-length cap for both
    config = PolicyConfig(k=4, dynamic=dynamic, k_max=12)
    s = speculative(target, smol_tokenizer, proposer, PROMPT, stops, SpecPolicy(config, target_step_ms=1000.0))
    assert s.output_ids == b.output_ids
    assert s.method == "hybrid"
    assert {st.drafter for st in s.steps if st.drafted} == {"draft", "ngram"}
    assert all(st.drafter == "" for st in s.steps if not st.drafted)


@pytest.mark.parametrize("prompt_len,k", [(9, 4), (60, 8), (64, 1), (100, 6)])
def test_first_pass_reads_prompt_and_drafts_as_the_baseline_does(tiny_pair, prompt_len, k):
    """Step 0's target pass reads the prompt and the first drafts together. Its logits and its cache must be bitwise
    the baseline's (a prefill, then one token per pass), also where the pass crosses the length at which attention
    switches from one call per query to one fused call (64 queries)."""
    target, _ = tiny_pair
    ids = torch.randint(0, 512, (prompt_len + k,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    one_by_one = new_cache(target)
    expected = torch.cat([forward(target, ids[:prompt_len], one_by_one, keep=1)]
                         + [forward(target, [t], one_by_one, keep=1) for t in ids[prompt_len:]])  # [k+1, V]
    folded = new_cache(target)
    assert torch.equal(forward(target, ids, folded, keep=k + 1, prompt_rows=prompt_len), expected)
    for a, b in zip(one_by_one.layers, folded.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_step_0_drafts(tiny_pair, smol_tokenizer):
    """No pass of its own for the prompt: step 0 drafts, and the baseline's output is kept."""
    target, draft = tiny_pair
    stops = StopConditions(30)
    prompt = PROMPT * 8  # 72 tokens: the prompt's rows take the fused attention call
    b = baseline(target, smol_tokenizer, prompt, stops)
    passes = []
    # the output layer runs once a target pass (the model's own __call__ does not: engine.exact.decoder)
    hook = target.lm_head.register_forward_hook(lambda module, args, out: passes.append(1))
    try:
        s = speculative(target, smol_tokenizer, draft_proposer(draft, target), prompt, stops, fixed(6))
    finally:
        hook.remove()
    assert s.output_ids == b.output_ids
    assert s.steps[0].drafted == 6 and s.prefill_ms == s.steps[0].verify_ms
    assert len(passes) == len(s.steps)  # one target pass per step, step 0's included


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 17])
def test_max_tokens_never_overshoots(tiny_pair, smol_tokenizer, max_new):
    target, draft = tiny_pair
    stops = StopConditions(max_new)
    b = baseline(target, smol_tokenizer, PROMPT, stops)
    s = speculative(target, smol_tokenizer, draft_proposer(draft, target), PROMPT, stops, fixed(8))
    assert s.output_ids == b.output_ids
    assert len(s.output_ids) == max_new


def test_eos_in_the_middle_of_a_step(tiny_pair, smol_tokenizer):
    target, draft = tiny_pair
    free = speculative(target, smol_tokenizer, draft_proposer(draft, target), PROMPT, StopConditions(60), fixed(4))
    # an accepted token with more committed tokens after it in its step makes a mid-step EOS
    mid = next(
        t for t in free.tokens
        if t.kind == TokenKind.ACCEPTED and t.index > 3 and free.output_ids.index(t.token_id) == t.index
        and free.steps[t.step].emitted > t.position + 1
    )
    stops = StopConditions(60, eos_ids=frozenset({mid.token_id}))
    b = baseline(target, smol_tokenizer, PROMPT, stops)
    s = speculative(target, smol_tokenizer, draft_proposer(draft, target), PROMPT, stops, fixed(4))
    assert b.finish_reason == s.finish_reason == "eos"
    assert s.output_ids == b.output_ids == free.output_ids[: mid.index + 1]


def test_stop_string_in_the_middle_of_a_step(tiny_pair, smol_tokenizer):
    target, draft = tiny_pair
    free = speculative(target, smol_tokenizer, draft_proposer(draft, target), PROMPT, StopConditions(60), fixed(4))
    text = ""
    for t in free.output_tokens:
        before, text = text, text + t.text
        mid_step = t.kind == TokenKind.ACCEPTED and free.steps[t.step].emitted > t.position + 1
        if mid_step and t.index > 3 and t.text:
            # the shortest tail of the text that first appears with this token
            stop = next((text[-n:] for n in range(1, len(text) + 1) if text[-n:] not in before), None)
            if stop:
                break
    else:
        pytest.fail("no accepted token with text in the middle of a step")
    stops = StopConditions(60, stop_strings=(stop,))
    b = baseline(target, smol_tokenizer, PROMPT, stops)
    s = speculative(target, smol_tokenizer, draft_proposer(draft, target), PROMPT, stops, fixed(4))
    assert b.finish_reason == s.finish_reason == "stop"
    assert s.output_ids == b.output_ids == free.output_ids[: t.index + 1]
    assert s.output_text.endswith(stop)
    # the stop cut the last step after t's position: its drafts after that are ignored, the ones before accepted
    last = s.steps[-1]
    assert (last.accepted, last.emitted, last.ignored) == (t.position + 1, t.position + 1, 4 - t.position - 1)
    assert s.metrics.ignored_drafts == 4 - t.position - 1
    assert all(step.ignored == 0 for step in s.steps[:-1]) and free.metrics.ignored_drafts == 0
