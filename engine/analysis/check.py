"""The sampling check: is the speculative engine's sampled output as likely under the target as the target's own?

Greedy runs are checked token for token (engine.metrics.compare). A sampled speculative run cannot be compared
token by token, but a lossless sampler (Leviathan et al.) produces outputs distributed exactly as the target's own
sampling, so three things can be checked on every sampled comparison:

1. Likelihood. The backend scores both outputs under the target given the same prompt (`backend.score`): the
   per-token negative log-likelihood (NLL, nats, under the target's raw distribution, temperature 1). Both outputs
   are samples of the same distribution, so their mean NLLs differ only by sampling noise; a speculative output
   whose mean NLL exceeds the baseline's by more than the noise measured between lossless samples is suspect
   (NLL_MARGINS). One pair is one sample each: above temperature 1 a small model's own samples often wander off
   into text it finds unlikely, so the margin there is wide, and a second rule carries the check:
2. Absurd tokens. A sampler that works does not pick tokens the target gives less than e^-20 (2e-9): over all
   calibration samples, none did. A broken one does (a negative or denormal temperature inverts or flattens p);
   one such token is enough, unless the baseline's output has one too.
3. Acceptance. On a prompt the baseline answers by copying from the prompt, drafts are right most of the time; a
   sampler that accepts none of many drafts there is broken.

The verdict is "ok" or "suspect" with a reason quoting the numbers; None for greedy runs and for runs that did not
complete (nothing to check). Scoring runs after both engines finished, outside any timed section.
"""

from __future__ import annotations

import logging
import math
import re

log = logging.getLogger(__name__)

# Calibration (python -m benchmarks.calibrate_check; the figures are in docs/sampling-check.md):
# SmolLM2-135M-Instruct on the local engine, n-gram drafts K=4, 4 prompts of each of the 6 suite categories at
# temperatures 0.4, 0.7, 1.0 and 1.2, 16 and 64 new tokens, two seeds: 384 lossless pairs. NLL_speculative -
# NLL_baseline (over the shorter length) stayed within 1.42 nats/token below temperature 1 (190 pairs; 0.99 for 32
# tokens or more) and within 2.96 from 1 on (192 pairs); each margin is 1.5 times that, rounded up to half a nat.
NLL_MARGINS = ((1.0, 2.5), (math.inf, 4.5))  # (below this temperature, the margin in nats/token)
# The difference must also be large against the spread of the baseline's own tokens (z_score): a weaker model than
# the one calibrated on, whose tokens are all uncertain, differs more between lossless samples.
Z_MIN = 3.0
MIN_TOKENS = 8  # fewer scored tokens than this on either side: too few to judge by likelihood
# No calibration token had an NLL above 17.4 (0 of 28,916 above 20); a broken sampler's picks reach 20-29.
ABSURD_NLL = 20.0  # nats: target probability below 2e-9
MAX_TEMPERATURE = 1.2  # the highest calibrated: above it, a flat target makes improbable tokens plausible samples

# Acceptance rule: no accepted draft among at least this many, at temperature > 0, while the baseline's output
# copies at least COPY_FRACTION of its word trigrams from the prompt.
MIN_DRAFTS = 16
COPY_FRACTION = 0.5


def nll_margin(temperature: float) -> float:
    return next(margin for below, margin in NLL_MARGINS if temperature < below)


def nll_stats(logprobs: list[float]) -> dict:
    """The number of tokens, their mean NLL, its perplexity, and the spread of the per-token NLL."""
    n = len(logprobs)
    if n == 0:
        return {"n": 0, "mean": None, "perplexity": None, "sd": None}
    mean = -sum(logprobs) / n
    sd = math.sqrt(sum((-lp - mean) ** 2 for lp in logprobs) / (n - 1)) if n > 1 else 0.0
    return {"n": n, "mean": mean, "perplexity": math.exp(mean), "sd": sd}


def z_score(base: dict, spec: dict) -> float:
    """The NLL difference in standard errors, with the spread of the baseline's tokens: were both outputs samples of
    the same distribution, the baseline's tokens would show the spread of both (a broken sampler's own spread is
    inflated by its mix of plausible and absurd tokens, so it is not used)."""
    se = base["sd"] * math.sqrt(1 / base["n"] + 1 / spec["n"])
    diff = spec["mean"] - base["mean"]
    return diff / se if se > 0 else math.copysign(math.inf, diff) if diff else 0.0


_WORD = re.compile(r"\w+|[^\w\s]")


def copy_fraction(prompt: str, output: str) -> float:
    """Share of the output's word trigrams that occur in the prompt (1.0: the output is copied from the prompt)."""
    def trigrams(text: str) -> list[tuple[str, ...]]:
        words = _WORD.findall(text)
        return [tuple(words[i:i + 3]) for i in range(len(words) - 2)]

    out = trigrams(output)
    if not out:
        return 0.0
    source = set(trigrams(prompt))
    return sum(t in source for t in out) / len(out)


def verdict(base: list[float], spec: list[float], temperature: float, drafted: int | None, accepted: int | None,
            copied: float) -> tuple[str, str]:
    """("ok" | "suspect", the reason with its numbers) from both outputs' per-token log-probabilities. Likelihoods
    are compared over the same number of tokens: an output that stopped early (a copied answer and its end) is more
    predictable than one that went on, and the first m tokens of two lossless outputs are samples of the same
    distribution."""
    m = min(len(base), len(spec))
    b, s = nll_stats(base[:m]), nll_stats(spec[:m])
    calibrated = temperature <= MAX_TEMPERATURE
    enough = m >= MIN_TOKENS and calibrated
    over = f" over the first {m} tokens" if m < max(len(base), len(spec)) else ""
    reasons = []
    margin = nll_margin(temperature)
    if enough and s["mean"] - b["mean"] > margin and z_score(b, s) > Z_MIN:
        reasons.append(f"the speculative output is far less likely under the target than the baseline's: NLL "
                       f"{s['mean']:.2f} vs {b['mean']:.2f} nats/token{over}, {z_score(b, s):.1f} standard errors "
                       f"(lossless samples stay within {margin:.1f} nats at temperature {temperature:g})")
    absurd, base_absurd = sum(lp < -ABSURD_NLL for lp in spec), sum(lp < -ABSURD_NLL for lp in base)
    if calibrated and absurd and not base_absurd:  # a baseline with such tokens: this target samples them itself
        reasons.append(f"{absurd} of {len(spec)} speculative tokens have a target probability below "
                       f"e^-{ABSURD_NLL:.0f} (2e-9), which no lossless sample in the calibration had")
    if temperature > 0 and drafted is not None and drafted >= MIN_DRAFTS and accepted == 0 and copied >= COPY_FRACTION:
        reasons.append(f"acceptance 0.00 over {drafted} drafts although the baseline copies {copied:.0%} of its "
                       "output from the prompt")
    if reasons:
        return "suspect", "; ".join(reasons)
    if not calibrated:
        return "ok", (f"likelihoods not judged above temperature {MAX_TEMPERATURE:g} (not calibrated there); "
                      "acceptance plausible")
    if not enough:
        return "ok", f"too few tokens to judge by likelihood ({len(base)} and {len(spec)}); no absurd tokens"
    return "ok", (f"NLL {s['mean']:.2f} vs {b['mean']:.2f} nats/token{over}: within the {margin:.1f} nats lossless "
                  "samples stay within; no absurd tokens")


def sampling_check(backend, req, results: dict) -> dict:
    """The comparison keys of the check for one finished comparison (see specconsole.runner.Comparison._save)."""
    if req.sampling.greedy:
        return {"sampling_check": None}
    b, s = results.get("baseline"), results.get("speculative")
    if b is None or s is None or b.error or s.error or "cancelled" in (b.finish_reason, s.finish_reason):
        return {"sampling_check": None, "sampling_check_reason": "not checked: the run did not complete"}
    try:
        scored = backend.score(req, [b.output_ids, s.output_ids])
    except Exception as e:  # noqa: BLE001 - a check that cannot run says so; the run itself is kept
        log.warning("the sampling check could not score the outputs: %s", e)
        return {"sampling_check": None, "sampling_check_reason": f"not checked: scoring failed: {e}"}
    prompt = "\n".join([c for _, c in req.earlier_turns] + [req.prompt])
    copied = copy_fraction(prompt, b.output_text)
    m = s.metrics
    status, reason = verdict(scored[0], scored[1], req.sampling.temperature, m.drafted, m.accepted,
                             copied)
    base, spec = nll_stats(scored[0]), nll_stats(scored[1])
    return {
        "sampling_check": status, "sampling_check_reason": reason,
        "nll_baseline": base["mean"], "nll_speculative": spec["mean"],
        "perplexity_baseline": base["perplexity"], "perplexity_speculative": spec["perplexity"],
        "nll_tokens": [base["n"], spec["n"]], "copy_fraction": copied,
    }
