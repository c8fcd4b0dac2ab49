"""The statistics behind every verdict (engine/analysis/stats.py): bootstrap intervals against scipy and against cases worked
out by hand, the A/B ratio interval, and the prompts-needed estimate."""

import math
import statistics

import numpy as np
import pytest
from scipy import stats

from engine.analysis.stats import against_target, bootstrap_ci, log_spread, prompts_needed, ratio_ci

RNG = np.random.default_rng(7)
SPEEDUPS = {n: RNG.lognormal(0.2, 0.3, n) for n in (5, 8, 20)}  # skewed, like per-prompt speedups


@pytest.mark.parametrize("n", sorted(SPEEDUPS))
@pytest.mark.parametrize("ours, theirs", [(statistics.median, np.median), (statistics.mean, np.mean),
                                          (statistics.geometric_mean, stats.gmean)])  # the last: row by row
def test_bootstrap_matches_scipy_percentile(n, ours, theirs):
    values = SPEEDUPS[n]
    point, low, high = bootstrap_ci(values, ours)
    ci = stats.bootstrap((values,), theirs, method="percentile", n_resamples=10_000, random_state=1).confidence_interval
    assert point == pytest.approx(float(theirs(values)))
    assert low == pytest.approx(ci.low, rel=0.02) and high == pytest.approx(ci.high, rel=0.02)
    assert low <= point <= high


def test_bootstrap_by_hand():
    assert bootstrap_ci([1.3]) == (1.3, 1.3, 1.3)  # one prompt: no width
    assert bootstrap_ci([1.2, 1.2, 1.2, 1.2]) == (1.2, 1.2, 1.2)  # identical values: every resample is the same
    # two values a < b: a resample's median is a (1/4 of draws), (a+b)/2 (1/2) or b (1/4), so the 2.5th and 97.5th
    # percentiles are a and b themselves
    assert bootstrap_ci([0.96, 1.42]) == pytest.approx((1.19, 0.96, 1.42))
    assert bootstrap_ci([1.42, 0.96], seed=9) == pytest.approx((1.19, 0.96, 1.42))  # whatever the order or seed
    # reproducible: the same data and seed give the same figures
    assert bootstrap_ci(SPEEDUPS[8]) == bootstrap_ci(list(SPEEDUPS[8]))
    with pytest.raises(ValueError):
        bootstrap_ci([])


def test_ratio_paired_and_unpaired_against_scipy():
    a = SPEEDUPS[8]
    b = a * RNG.lognormal(0.1, 0.05, a.size)  # B about 10 % faster on every prompt, plus a little noise
    paired = stats.bootstrap((a, b), lambda x, y, axis=-1: np.median(y / x, axis=axis), paired=True,
                             method="percentile", random_state=1).confidence_interval
    point, low, high = ratio_ci(a, b, paired=True)
    assert point == pytest.approx(np.median(b / a))
    assert low == pytest.approx(paired.low, rel=0.02) and high == pytest.approx(paired.high, rel=0.02)
    unpaired = stats.bootstrap((a, b), lambda x, y, axis=-1: np.median(y, axis=axis) / np.median(x, axis=axis),
                               paired=False, method="percentile", random_state=1).confidence_interval
    point_u, low_u, high_u = ratio_ci(a, b, paired=False)
    assert point_u == pytest.approx(np.median(b) / np.median(a))
    assert low_u == pytest.approx(unpaired.low, rel=0.02) and high_u == pytest.approx(unpaired.high, rel=0.02)
    # pairing removes the spread between prompts: the paired interval is far narrower and clear of 1
    assert high - low < (high_u - low_u) / 3 and low > 1 > low_u


def test_ratio_by_hand():
    assert ratio_ci([1.0, 2.0, 3.0], [1.1, 2.2, 3.3], paired=True) == pytest.approx((1.1, 1.1, 1.1))
    assert ratio_ci([2.0], [3.0], paired=False) == (1.5, 1.5, 1.5)
    with pytest.raises(ValueError):
        ratio_ci([1.0, 2.0], [1.0], paired=True)


def test_prompts_needed_by_hand():
    # 0.96x and 1.42x: median 1.19x, log spread |ln 1.42 - ln 0.96| / sqrt 2 = 0.2768, distance to the 1.05x
    # threshold ln 1.19 - ln 1.05 = 0.1252; n = (1.96 * 0.2768 / 0.1252)^2 = 18.8 -> 19
    assert log_spread([0.96, 1.42]) == pytest.approx(abs(math.log(1.42 / 0.96)) / math.sqrt(2))
    assert prompts_needed([0.96, 1.42]) == 19
    # below 1.0x the threshold is 1.0: median 0.85, spread of ln 0.8 and ln 0.9, d = -ln 0.85
    s = abs(math.log(0.9 / 0.8)) / math.sqrt(2)
    assert prompts_needed([0.8, 0.9]) == math.ceil((1.959964 * s / -math.log(0.85)) ** 2)
    # a wider spread needs more prompts; a clearer gain fewer
    assert prompts_needed([0.8, 1.6]) > prompts_needed([0.96, 1.42]) > prompts_needed([1.8, 2.6])
    assert prompts_needed([2.0, 2.0]) == 1  # no spread at all
    # inside the undecided band [1.0, 1.05) no number of prompts decides it
    assert prompts_needed([0.9, 1.14]) is None and prompts_needed([1.0, 1.0]) is None
    with pytest.raises(ValueError):
        prompts_needed([1.3])


@pytest.mark.parametrize("low, high, floor, ceiling, expected", [
    (0.96, 1.04, 0.95, 1.05, "met"),  # the whole interval inside
    (0.93, 1.01, 0.95, 1.05, "cannot tell"),  # straddles the floor
    (0.97, 1.08, 0.95, 1.05, "cannot tell"),  # straddles the ceiling
    (1.06, 1.20, 0.95, 1.05, "not met"),  # all above the ceiling
    (0.80, 0.94, 0.95, None, "not met"),  # a floor only: all below
    (0.95, 3.00, 0.95, None, "met"),  # a bound is inclusive
    (0.10, 0.14, None, 0.15, "met"),  # a ceiling only (the browser's cores)
])
def test_against_target(low, high, floor, ceiling, expected):
    assert against_target(low, high, floor, ceiling) == expected
