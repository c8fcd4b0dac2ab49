"""The page without a browser (specconsole.app, tab_run): it builds with its elements, greys out the settings the
backend does not apply, and builds requests from the same defaults as launch.py."""

import gradio as gr

from engine.backend import MAX_EXTRA
from specconsole.history import History


def test_one_set_of_request_defaults():
    """The page's controls, `launch.py demo` and `launch.py suite` build requests alike, from the same defaults."""
    import argparse

    from specconsole import cli
    from engine import request as r

    demo = argparse.ArgumentParser()
    cli.add_request_args(demo)
    assert cli.build_request(demo.parse_args([]), "p", "draft") == r.build_request("p")
    suite = argparse.ArgumentParser()
    cli.add_request_args(suite, suite=True)
    assert cli.build_request(suite.parse_args([]), "", "draft") == r.build_request(
        "", max_new_tokens=r.SUITE_MAX_NEW_TOKENS)
    req = r.build_request("p", max_new_tokens=12.0, seed="", k=20.0, method="ngram", draft_confidence=0.5,
                          draft_vocab=4096.0)
    d = req.drafting
    assert (req.max_new_tokens, req.sampling.seed, d.k, d.k_max, d.draft_confidence, d.draft_vocab) == (
        12, None, 20, 20, 0.0, 0)
    assert r.build_request("p", method="hybrid", draft_vocab=4096.0).drafting.draft_vocab == 4096
    assert r.build_request("p", draft_vocab=None).drafting.draft_vocab == 0  # an emptied number box


def test_page_greys_out_what_the_backend_does_not_apply(backend):
    from specconsole.host import ModelHost
    from specconsole.run_layout import DRAFTING_CONTROLS, backend_view
    from tests.test_workbench import RestartableServer, ServerLike

    host = ModelHost("x", lambda p: None)
    assert all(u == gr.skip() for u in backend_view(host))  # still loading: nothing changes yet
    host.backend = ServerLike(backend)
    *controls, section, server_method, server_k, compare, costs, costs_text = backend_view(host)
    assert len(controls) == len(DRAFTING_CONTROLS)
    assert all(u["interactive"] is False and "set by the speculative server (eagle)" in u["info"] for u in controls)
    assert section["visible"] is False  # attached servers cannot be reconfigured from the page
    assert server_method == gr.skip()  # nor do they say which methods they could run
    assert compare == gr.skip()  # not fixed variants: the presets stay
    assert costs["visible"] is False  # a server's own policy drafts: no cost model of ours to show
    # a server the console started: its section offers the backend's own methods, the served one picked
    host.backend = RestartableServer(backend)
    _, section, server_method, server_k, *_ = backend_view(host)[len(DRAFTING_CONTROLS) - 1:]
    assert section["visible"] is True
    assert server_method["choices"] == ["eagle", "ngram"] and server_method["value"] == "eagle"
    assert server_k["value"] == 4  # the K it serves
    host.backend = backend
    *controls, section, server_method, server_k, compare, costs, costs_text = backend_view(host)
    assert all(u["interactive"] is True for u in controls) and section["visible"] is False
    # our policy's cost model, shown with what it measured
    assert costs["visible"] is True and "a plain target step" in costs_text and "draft token" in costs_text


def test_the_k_sliders_span_the_k_the_backend_drafts(backend, tmp_path):
    """The Run tab's K and the speculative server's K offer what the backend drafts (Capabilities.k_range), whether
    the backend is loaded before the page is built or after (backend_view); engine.limits' K until then."""
    from dataclasses import replace

    from engine.limits import MAX_K
    from specconsole.app import build
    from specconsole.host import ModelHost
    from specconsole.run_layout import DRAFTING_CONTROLS, backend_view
    from tests.test_workbench import RestartableServer

    def sliders(app) -> list[tuple[int, int]]:  # the Run tab's K, the server's K
        return [(b.minimum, b.maximum) for b in app.blocks.values() if isinstance(b, gr.Slider)
                and b.label.startswith("K (")]

    host = ModelHost("x", lambda p: None)
    assert sliders(build(host, History(tmp_path / "h.db"))) == [(1, MAX_K)] * 2
    server = RestartableServer(backend)
    server.capabilities = replace(server.capabilities, k_range=(2, 8))
    host.backend = server
    assert sliders(build(host, History(tmp_path / "h.db"))) == [(2, 8)] * 2
    updates = backend_view(host)
    k, server_k = updates[DRAFTING_CONTROLS.index("k")], updates[len(DRAFTING_CONTROLS) + 2]
    assert (k["minimum"], k["maximum"]) == (server_k["minimum"], server_k["maximum"]) == (2, 8)


def test_the_page_builds_with_its_elements(tmp_path):
    from specconsole.app import build
    from specconsole.host import ModelHost

    app = build(ModelHost("not loaded", lambda p: None), History(tmp_path / "h.db"))
    ids = {getattr(b, "elem_id", None) for b in app.blocks.values()}
    assert {"model-status", "prompt", "run", "stop", "temperature", "max-new", "baseline-panel", "speculative-panel",
            "figures", "chart-steps", "chart-time", "history-table", "export-all", "open-run", "run-suite",
            "suite-status", "export-suite", "suite-files", "one-at-a-time"} <= ids


def test_a_runs_updates_name_few_components(tmp_path):
    """The browser's work per update grows with the components the update names, shown or hidden (docs/page-cost.md:
    naming the hidden N-way panels, columns and headings cost about a fifth of the browser's CPU with the int4
    target): the run streams through one panel feed, the figures and the charts; the extra panels' layout is set
    by an event of its own before the run."""
    from specconsole.app import build
    from specconsole.host import ModelHost

    app = build(ModelHost("not loaded", lambda p: None), History(tmp_path / "h.db"))
    by_id = {b._id: getattr(b, "elem_id", None) for b in app.blocks.values()}
    (run,) = [f for f in app.fns.values() if f.name == "run"]
    assert [by_id[o._id] for o in run.outputs] == ["panel-feed", "figures", "chart-steps", "chart-positions",
                                                  "chart-tokens", "chart-time"]
    (plan,) = [f for f in app.fns.values() if f.name == "plan"]
    assert len(plan.outputs) == 2 * MAX_EXTRA and not plan.queue  # columns and headings, at once


def test_every_event_shows_progress_on_one_component(tmp_path):
    """Gradio's page re-reads, on every update a run streams, each component that any event shows its progress on
    (by default: all of the event's outputs, the four charts and the History table among them; docs/page-cost.md):
    each event names at most one, and the run's is its panel feed."""
    from specconsole.app import build
    from specconsole.host import ModelHost

    app = build(ModelHost("not loaded", lambda p: None), History(tmp_path / "h.db"))
    shown = {f"{f.name} #{i}": f.show_progress_on or f.outputs for i, f in enumerate(app.fns.values())}
    assert {name: len(targets) for name, targets in shown.items() if len(targets) > 1} == {}
    by_name = {f.name: f for f in app.fns.values()}
    assert [getattr(c, "elem_id", None) for c in by_name["run"].show_progress_on] == ["panel-feed"]
    assert by_name["plan"].show_progress_on == by_name["run"].show_progress_on


def test_a_chart_update_reaches_the_page_without_a_panel_change():
    """The page fades the last run's charts until the run's first chart update (assets/live_panel.js): an update
    that carries only charts still names the run, or the charts would stay faded."""
    import json

    from specconsole.run_stream import feed_of

    assert feed_of({"baseline": None, "speculative": None}, run="r1") is None  # nothing changes
    assert json.loads(feed_of({"baseline": None}, charts=True, run="r1")) == {"panels": {}, "run": "r1",
                                                                             "charts": True}


def test_the_panels_update_less_often_the_more_of_them_there_are(backend):
    """The browser's work per update grows with the panels it appends to (docs/page-cost.md): five panels update
    less often than two; where updates land in timed runs (race mode) never more than PANEL_WHILE_TIMED_S allows."""
    from engine.request import build_request
    from specconsole.run_stream import PANEL_WHILE_TIMED_S, panel_interval
    from specconsole.runner import Comparison
    from specconsole.variants import Variant

    request = build_request("p", max_new_tokens=4)
    extra = [Variant(f"K={k}", build_request("p", max_new_tokens=4, k=k, dynamic_k=False)) for k in (2, 3, 4)]
    two, five = (Comparison(backend, request, "fair", None, {}, extra=e) for e in ((), extra))
    assert panel_interval(two) < panel_interval(five)
    assert panel_interval(Comparison(backend, request, "race", None, {})) >= PANEL_WHILE_TIMED_S


def test_a_stored_cost_model_is_read_as_numbers_and_its_text_escaped(tmp_path, monkeypatch):
    """The calibration file under the cache is input: its costs are read as numbers (a string figure is converted,
    not passed through), its date is shown as literal text, bounded, and nothing else of it reaches the page."""
    import json

    from engine.exact import calibration
    from specconsole.run_layout import costs_markdown

    monkeypatch.setenv("SPECCONSOLE_CACHE", str(tmp_path))
    models = {"target_model": "t", "draft_model": None}
    path = tmp_path / "calibration" / f"{calibration.key(models)}.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"target_step_ms": "50.0", "verify_ms": {"1": "50.0", "5": 60}, "draft_ms_per_token":
                                None, "measured_at": "<img src=x onerror=alert(1)>*bold*" * 10,
                                "machine": "not a dict"}))
    costs, about = calibration.stored(models, None, None)
    assert costs.verify_ms == {1: 50.0, 5: 60.0} and costs.target_step_ms == 50.0
    text = costs_markdown(calibration.as_dict(costs, about))
    assert "a plain target step **50.0 ms**" in text and "<img" not in text and "not a dict" not in text
    assert len(about["measured_at"]) <= 40
