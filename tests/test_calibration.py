"""engine.exact.calibration: costs measured while other processes take the CPU are not stored; the curve is
padded."""

from __future__ import annotations

from engine.exact import calibration
from tests.test_runner import _hog


def test_costs_measured_beside_a_cpu_hog_are_kept_for_this_start_only_and_quiet_ones_are_stored(
        tiny_pair, tmp_path, monkeypatch):
    from specconsole.run_layout import costs_markdown

    monkeypatch.setenv("SPECCONSOLE_CACHE", str(tmp_path))
    target, draft = tiny_pair
    models = {"target_model": "tiny", "draft_model": "tiny draft"}
    hogs = [_hog(30), _hog(30)]  # both cores
    try:
        costs, about = calibration.stored(models, target, draft)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert about["others_cores"] > calibration.OTHERS_MAX and about["file"] is None
    assert not list(tmp_path.glob("calibration/*.json")) and costs.draft_ms_per_token > 0
    assert "the next start measures them again" in costs_markdown(calibration.as_dict(costs, about))

    costs, about = calibration.stored(models, target, draft)  # quiet: measured again, and stored
    assert "others_cores" not in about and len(list(tmp_path.glob("calibration/*.json"))) == 1
    assert "measures them again" not in costs_markdown(calibration.as_dict(costs, about))


def test_a_shorter_pass_never_costs_more_than_a_longer_one():
    """A disturbed short pass is padded down to the next longer pass's cost; a rising curve stays as measured."""
    measured = {1: 72.6, 2: 50.4, 3: 54.6, 4: 53.0, 5: 80.2}
    assert calibration.padded(measured) == {1: 50.4, 2: 50.4, 3: 53.0, 4: 53.0, 5: 80.2}
    rising = {1: 42.0, 2: 48.0, 3: 55.0}
    assert calibration.padded(rising) == rising
