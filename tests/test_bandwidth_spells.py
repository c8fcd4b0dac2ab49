"""benchmarks.bandwidth: telling a run's slow spells of memory bandwidth from its fast ones, and a real reading."""

import math

from benchmarks import bandwidth


def test_one_spell_has_no_split():
    assert bandwidth.split([(60.0, 62.0), (58.0, 61.0), (63.0, 63.0)]) is None
    assert bandwidth.spell((60.0, 62.0), None) == "one"


def test_two_spells_split_at_their_geometric_middle():
    readings = [(36.0, 37.0), (63.0, 62.0), (35.0, 64.0), (37.0, 36.0)]
    threshold = bandwidth.split(readings)
    assert math.isclose(threshold, math.sqrt(36.0 * 62.0))  # steady repeats by their lower reading; (35, 64) changed
    assert [bandwidth.spell(r, threshold) for r in readings] == ["slow", "fast", "mixed", "slow"]


def test_no_steady_repeat_is_no_spell():
    assert bandwidth.split([(35.0, 64.0), (63.0, 36.0)]) is None
    assert not any(bandwidth.steady(r) for r in [(35.0, 64.0), (63.0, 36.0)])


def test_a_reading_is_a_bandwidth():
    probe = bandwidth.Probe(mib=64)
    assert probe.buffer.nbytes == 64 << 20
    assert 0.5 < probe.gbs() < 2000  # GB/s: a memory read, not a cache's or a clock's artefact
