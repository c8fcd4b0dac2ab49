"""Confidence intervals for speedups measured on a handful of prompts, and how many prompts a decision needs.

The statistic, wherever a decision is made (the Workbench and its advisor, the A/B of two suites, the speed
benchmark): a category's speedup is the MEDIAN OVER ITS PROMPTS of each prompt's speedup (a prompt run several
times counts once, with the median of its repeats). Its 95 % confidence interval is the PERCENTILE BOOTSTRAP OVER
PROMPTS: draw as many prompts as were run, with replacement, 10 000 times, take the median of each draw, and the
interval runs from the 2.5th to the 97.5th percentile of those medians. The prompt, not the run, is the unit: the
question is how the engine does on this kind of workload, and repeats of one prompt only measure the machine's
noise. With one prompt the interval has no width; with two it spans both.
"""

from __future__ import annotations

import math
import statistics
from statistics import NormalDist
from typing import Callable, Sequence

import numpy as np

# numpy's vectorised equivalents of the usual statistics: one call over all resamples instead of a Python loop
_VECTORISED = {statistics.median: np.median, statistics.mean: np.mean, np.median: np.median, np.mean: np.mean}


def _resampled(data: np.ndarray, stat: Callable, n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """stat of n_resamples draws of len(data) values from data, with replacement."""
    draws = data[rng.integers(0, data.size, size=(n_resamples, data.size))]
    vectorised = _VECTORISED.get(stat)
    return vectorised(draws, axis=1) if vectorised else np.apply_along_axis(stat, 1, draws)


def _percentiles(resampled: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(resampled, [tail, 100 - tail])
    return float(low), float(high)


def bootstrap_ci(values: Sequence[float], stat: Callable = statistics.median, confidence: float = 0.95,
                 n_resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """(point, low, high): stat of the values and its percentile-bootstrap interval. values: finite numbers, one per
    prompt. The seed makes the interval reproducible: the same data always gives the same figures."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    point = float(stat(data.tolist()))
    if data.size == 1:
        return point, point, point
    low, high = _percentiles(_resampled(data, stat, n_resamples, np.random.default_rng(seed)), confidence)
    return point, low, high


def ratio_ci(a: Sequence[float], b: Sequence[float], paired: bool, confidence: float = 0.95,
             n_resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """(point, low, high) of B relative to A (1.08: B is 8 % higher).

    paired: a[i] and b[i] were measured on the same prompt; the statistic is the median of the per-prompt ratios
    b[i] / a[i], bootstrapped over prompts (each prompt is its own control, which removes the spread between
    prompts). Unpaired: the ratio of the medians, median(b) / median(a), each side resampled independently."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if paired:
        if a.size != b.size:
            raise ValueError(f"paired values need the same prompts on both sides, got {a.size} and {b.size}")
        return bootstrap_ci(b / a, np.median, confidence, n_resamples, seed)
    if a.size == 0 or b.size == 0:
        raise ValueError("ratio_ci needs at least one value on each side")
    point = float(np.median(b) / np.median(a))
    if a.size == 1 and b.size == 1:
        return point, point, point
    rng = np.random.default_rng(seed)
    ratios = _resampled(b, np.median, n_resamples, rng) / _resampled(a, np.median, n_resamples, rng)
    low, high = _percentiles(ratios, confidence)
    return point, low, high


def against_target(low: float, high: float, floor: float | None = None, ceiling: float | None = None) -> str:
    """A target judged by an interval [low, high]: "met" when all of it lies within [floor, ceiling] (None: no bound
    on that side), "not met" when all of it lies outside, else "cannot tell" (more runs would be needed)."""
    floor = -math.inf if floor is None else floor
    ceiling = math.inf if ceiling is None else ceiling
    if floor <= low and high <= ceiling:
        return "met"
    return "not met" if high < floor or low > ceiling else "cannot tell"


def log_spread(values: Sequence[float]) -> float:
    """Standard deviation of the log speedups across prompts: the spread, on the scale where 0.5x and 2x are as far
    from 1x."""
    return float(np.std(np.log(np.asarray(values, dtype=float)), ddof=1))


def prompts_needed(values: Sequence[float], enable_at: float = 1.05, slower_below: float = 1.0,
                   confidence: float = 0.95) -> int | None:
    """About how many prompts, at the spread seen between these, would put the interval clear of the nearer
    threshold: n = (z * s / d)^2, rounded up, where s is log_spread(values) and d = |log(point) - log(threshold)|
    (a normal approximation: a guide to how many more to run, not a guarantee; the bootstrap still decides).

    None when the point lies in the band [slower_below, enable_at): however many prompts are added, the interval
    then closes in on a figure that neither clears enable_at nor lies below slower_below."""
    if len(values) < 2:
        raise ValueError("the spread between prompts needs at least two prompts")
    point = statistics.median(values)
    if slower_below <= point < enable_at:
        return None
    threshold = enable_at if point >= enable_at else slower_below
    d = abs(math.log(point) - math.log(threshold))
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    return max(1, math.ceil((z * log_spread(values) / d) ** 2))
