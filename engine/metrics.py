"""Metrics of one run, the comparison of a speculative run with its baseline, and the theory to hold them against.

Theory (Leviathan et al. 2023, section 3): with per-token acceptance rate a and K drafts, a target pass yields on
average E = (1 - a^(K+1)) / (1 - a) tokens. If one draft step costs c target steps, the speedup is at most
E / (c*K + 1). That assumes verifying K+1 tokens costs one target step; on a CPU it costs v steps (measured), so the
bound for this machine is E / (c*K + v). Efficiency = measured speedup / the machine's bound.
"""

from __future__ import annotations

from statistics import mean

from engine.comparison import ComparisonFigures
from engine.events import PolicyAction, RunResult, TokenKind
from engine.run_metrics import RunMetrics


def expected_tokens_per_pass(a: float, k: float) -> float:
    if a >= 1.0:
        return k + 1
    return (1 - a ** (k + 1)) / (1 - a)


def speedup_bound(a: float, k: float, c: float, v: float = 1.0) -> float:
    return expected_tokens_per_pass(a, k) / (c * k + v)


def acceptance_alpha(steps) -> float:
    """Per-token acceptance probability (alpha), estimated from speculative steps: each step is a run of accepted
    drafts ended by at most one rejection, so alpha = accepted / (accepted + rejections), with a uniform prior that
    keeps a short history inside (0, 1). (accepted / drafted undercounts: drafts after a rejection are never tried.)"""
    accepted = sum(s.accepted for s in steps)
    rejections = sum(s.accepted < s.drafted for s in steps)
    return (accepted + 1) / (accepted + rejections + 2)


def run_metrics(r: RunResult) -> RunMetrics:
    out = r.output_tokens
    n = len(out)
    spec = [s for s in r.steps if s.drafted > 0]
    # what decoding steps cost: step 0 also read the prompt (its time is prefill_ms, its drafts count above)
    spec_decode = [s for s in spec if s.step > 0]
    plain = [s for s in r.steps if s.step > 0 and s.drafted == 0]
    drafted = sum(s.drafted for s in spec)
    accepted = sum(s.accepted for s in spec)
    max_k = max((s.drafted for s in spec), default=0)
    return RunMetrics(
        output_tokens=n,
        target_passes=len(r.steps),
        baseline_passes=n,  # plain decoding needs one target pass per token
        passes_saved=n - len(r.steps),
        steps=len(spec),
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else None,
        per_position_acceptance=[
            sum(s.accepted > i for s in spec) / sum(s.drafted > i for s in spec) for i in range(max_k)
        ],
        mean_accepted_length=1 + accepted / len(spec) if spec else None,
        mean_k=drafted / len(spec) if spec else None,
        ttft_ms=1000 * out[0].time_s if out else None,
        tpot_ms=1000 * (out[-1].time_s - out[0].time_s) / (n - 1) if n > 1 else None,
        tokens_per_s=n / r.total_s if r.total_s > 0 else None,
        decode_tokens_per_s=_decode_rate(r),
        prefill_ms=r.prefill_ms,
        draft_ms_total=sum(s.draft_ms for s in spec),
        verify_ms_total=sum(s.verify_ms for s in spec_decode),
        draft_ms_per_token=_per_token(spec_decode),
        verify_ms_mean=mean(s.verify_ms for s in spec_decode) if spec_decode else None,
        plain_step_ms=mean(s.verify_ms for s in plain) if plain else None,
        fallback_count=sum(e.action == PolicyAction.FALLBACK for e in r.policy),
        rejected_tokens=sum(t.kind == TokenKind.REJECTED for t in r.tokens),
        tree_accepted=_tree_accepted(r.tokens),
        ignored_drafts=None if any(s.ignored is None for s in spec) else sum(s.ignored for s in spec),
        # how many steps accepted 0, 1, ... drafts; a step that accepted none bought one token for a target pass
        # and a draft's cost
        acceptance_histogram=[sum(s.accepted == i for s in spec) for i in range(max_k + 1)] if spec else [],
        steps_accepting_nothing=sum(s.accepted == 0 for s in spec) / len(spec) if spec else None,
        **time_split(r),
    )


# a speculative engine that drafted nothing in its first this many target passes says so (speculation_idle)
IDLE_CHECK_PASSES = 8


def speculation_idle(r: RunResult) -> bool:
    """Whether a speculative engine's first IDLE_CHECK_PASSES target passes drafted nothing: speculation is off (a
    server started without its draft settings taking effect) or the drafter finds nothing to propose (an n-gram
    with no match). False while fewer passes are known, and for the baseline."""
    first = r.steps[:IDLE_CHECK_PASSES]
    return r.engine != "baseline" and len(first) == IDLE_CHECK_PASSES and not any(s.drafted for s in first)


def time_split(r: RunResult) -> dict:
    """Where the run's time went: drafting, the target's passes (the prefill included) and everything else (the
    stop checks, the events, the policy, a clock's gaps); None each where the steps carry no timings (servers)."""
    drafting = sum(s.draft_ms for s in r.steps)
    verifying = sum(s.verify_ms for s in r.steps)
    if not drafting + verifying:
        return {"drafting_ms": None, "verifying_ms": None, "other_ms": None}
    return {"drafting_ms": drafting, "verifying_ms": verifying,
            "other_ms": max(0.0, 1000 * r.total_s - drafting - verifying)}


def _tree_accepted(tokens) -> int:
    """Steps that accepted a token at a position where they refused the draft: one of the token tree's alternatives
    took its place (engine.exact.decode; a chain alone accepts nothing from its first refused position on)."""
    refused = {(t.step, t.position) for t in tokens if t.kind == TokenKind.REJECTED}
    return len({t.step for t in tokens if t.kind == TokenKind.ACCEPTED and (t.step, t.position) in refused})


def _decode_rate(r: RunResult) -> float | None:
    """Tokens per second after step 0, which commits the prefill's token and, when it drafted, the drafts it kept
    (those cost no decoding time, so counting them would flatter the decode rate)."""
    out = r.output_tokens
    first = r.steps[0].emitted if r.steps and r.steps[0].step == 0 else 1
    first = min(max(first, 1), len(out))
    if len(out) <= first or out[-1].time_s <= out[first - 1].time_s:
        return None
    return (len(out) - first) / (out[-1].time_s - out[first - 1].time_s)


def _per_token(steps) -> float | None:
    drafted = sum(s.drafted for s in steps)
    return sum(s.draft_ms for s in steps) / drafted if drafted else None


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None when the sequences are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(baseline: RunResult, speculative: RunResult, greedy: bool) -> ComparisonFigures:
    """Speedup, the theoretical bounds with the costs measured in these two runs, efficiency and exactness."""
    b, s = baseline.metrics, speculative.metrics
    figures = {"speedup": _ratio(s.tokens_per_s, b.tokens_per_s),
               "decode_speedup": _ratio(s.decode_tokens_per_s, b.decode_tokens_per_s)}
    step_ms = b.plain_step_ms  # one target decoding step, measured by the baseline
    steps = [st for st in speculative.steps if st.drafted > 0 and st.step > 0]  # decoding steps (not the prefill)
    if step_ms and steps and s.draft_ms_per_token:
        # Sum the model over the steps actually taken, so that a dynamic K is judged at the K it used.
        alpha = acceptance_alpha(steps)
        cost_c = s.draft_ms_per_token / step_ms
        tokens = sum(expected_tokens_per_pass(alpha, st.drafted) for st in steps)
        machine_bound = tokens / sum(cost_c * st.drafted + st.verify_ms / step_ms for st in steps)
        figures |= {
            "alpha": alpha,
            "draft_cost_ratio": cost_c,
            "verify_cost_ratio": s.verify_ms_mean / step_ms,
            "expected_tokens_per_pass": tokens / len(steps),
            "theoretical_bound": tokens / sum(cost_c * st.drafted + 1 for st in steps),
            "machine_bound": machine_bound,
            "efficiency": figures["decode_speedup"] / machine_bound if figures["decode_speedup"] else None,
        }
    if greedy:
        div = first_divergence(baseline.output_ids, speculative.output_ids)
        figures |= {"identical": div is None, "first_divergence": div}
        if div is not None:
            tie = near_tie(baseline, speculative, div)
            figures |= {"near_tie": tie, "divergence_margin": tie["baseline"]["margin"] if tie else None}
    return ComparisonFigures(**figures)


def near_tie(baseline: RunResult, speculative: RunResult, index: int) -> dict | None:
    """Why two greedy outputs part at output token `index`: each engine's pass there, as {"token", "text",
    "runner_up", "runner_up_text", "margin"} (margin: the token's logit minus the runner-up's; runner_up: its id,
    None from a server that names it by text, vLLM). Both margins small is a near-tie that passes of another shape
    round apart. None where an engine did not record its runner-up (llama.cpp, a vLLM server that sent no top 2, a
    sampled run, the bonus token after a token tree's alternative) or one output ended there."""
    pair = [r.output_tokens[index] if index < len(r.output_tokens) else None for r in (baseline, speculative)]
    if any(t is None or t.margin is None for t in pair):
        return None
    texts = {t.token_id: t.text for t in pair}  # in a near-tie each engine's runner-up is the other's token
    return {engine: {"token": t.token_id, "text": t.text, "runner_up": t.runner_up, "margin": t.margin,
                     "runner_up_text": t.runner_up_text if t.runner_up_text is not None else texts.get(t.runner_up)}
            for engine, t in zip(("baseline", "speculative"), pair)}


def _ratio(x, y):
    return x / y if x and y else None
