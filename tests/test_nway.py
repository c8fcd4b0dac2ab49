"""N-way comparison: the baseline and up to four speculative configurations in one run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from engine.drafting import Drafting
from engine.request import Request
from specconsole import backends, charts
from specconsole.export import export_all, export_csv
from specconsole.history import History
from specconsole.replay import payload
from specconsole.runner import Comparison
from specconsole.variants import PRESETS, Variant, from_presets, parse_compare, variant
from tests.conftest import PassLog, run_to_end

ROOT = Path(__file__).resolve().parent.parent


def four_way(base: Request) -> list[Variant]:
    """n-gram, draft K=4 fixed and hybrid next to the main (draft, dynamic K) engine."""
    return from_presets(base, ["n-gram", "draft K=4 fixed", "hybrid"])


@pytest.mark.parametrize("mode", ["fair", "race"])
def test_every_speculative_engine_is_identical_to_the_baseline_when_greedy(backend, mode):
    base = Request(prompt="def fib(n): return fib(n - 1) + fib(n - 2)", max_new_tokens=24,
                   drafting=Drafting(method="draft", k=3, dynamic_k=True))
    comp = run_to_end(Comparison(backend, base, mode, None, {}, extra=four_way(base)))
    assert comp.engines == ("baseline", "speculative", "speculative-2", "speculative-3", "speculative-4")
    results = comp.results
    assert {e: r.engine for e, r in results.items()} == {e: e for e in comp.engines}  # each keeps its own name
    assert [r.method for r in results.values()] == ["none", "draft", "ngram", "draft", "hybrid"]
    baseline = results["baseline"].output_ids
    assert len(baseline) == 24
    comparisons = comp.comparisons()
    assert list(comparisons) == ["speculative", "speculative-2", "speculative-3", "speculative-4"]
    for engine, c in comparisons.items():
        assert results[engine].output_ids == baseline, engine
        assert c.identical is True and c.first_divergence is None and c.speedup, engine
    # the K=4 fixed engine drafted 4 at a time, the n-gram one by lookup
    assert max(s.drafted for s in results["speculative-3"].steps) == 4  # fewer only where the answer's end is near
    assert {s.drafter for s in results["speculative-2"].steps if s.drafted} <= {"ngram"}


def test_a_diverging_extra_engine_is_reported(backend, monkeypatch):
    """The comparison of each engine is its own: a broken extra engine diverges, the others stay identical."""
    base = Request(prompt="hello there", max_new_tokens=12, drafting=Drafting(method="draft", k=2))
    original = backend.speculative

    def broken(req, cancel=None, clock=None):
        for event in original(req, cancel, clock):
            if req.drafting.method == "ngram" and hasattr(event, "output_ids") and event.output_ids:
                event = replace(event, output_ids=[event.output_ids[0] + 1, *event.output_ids[1:]])
            yield event

    monkeypatch.setattr(backend, "speculative", broken)
    comp = run_to_end(Comparison(backend, base, "fair", None, {}, extra=from_presets(base, ["n-gram"])))
    c = comp.comparisons()
    assert c["speculative"].identical is True
    assert c["speculative-2"].identical is False and c["speculative-2"].first_divergence == 0


def test_fair_mode_takes_turns_across_all_engines(backend):
    base = Request(prompt="hello there", max_new_tokens=30, drafting=Drafting(method="draft", k=2, dynamic_k=False))
    extra = [variant(base, "n-gram", method="ngram"), variant(base, "draft K=3", k=3)]
    comp = Comparison(backend, base, "fair", None, {}, extra=extra)
    log = PassLog(backend, {id(req): e for e, req in comp.requests.items() if e != "baseline"})
    comp.backend = log
    run_to_end(comp)
    engines = comp.engines
    rounds = min(log.passes.count(e) for e in engines)  # while every engine still had passes to take
    assert rounds >= 4
    for i in range(rounds):  # one pass each, in the same order, round after round
        assert log.passes[i * len(engines):(i + 1) * len(engines)] == list(engines)
    # each engine's clock stood still while the others computed (read around every event they made), and each
    # engine's total is on its own clock, which holds its own passes
    assert all(log.watched[e] >= 2 * rounds for e in engines) and log.moved == [], log.moved[:5]
    results = comp.results
    for e in engines:
        own = sum(st.verify_ms + st.draft_ms for st in results[e].steps) / 1000
        assert own <= results[e].total_s <= log.clocks[e](), e


def test_three_engine_run_round_trips_through_the_history(backend, tmp_path):
    history = History(tmp_path / "h.db")
    base = Request(prompt="=cmd <b>bold</b>", max_new_tokens=16, drafting=Drafting(method="draft", k=3))
    extra = [variant(base, "n-gram", method="ngram")]
    meta = {"category": "code", "backend": "local", "method": "draft"}
    comp = run_to_end(Comparison(backend, base, "fair", history, meta, extra=extra, label="draft dynamic K"))
    row = history.run(comp.run_id)
    assert row["status"] == "completed" and row["identical"] == 1  # the headline figures
    assert history.engines(comp.run_id)["speculative"]["output"] == comp.results["speculative"].output_text
    rebuilt = history.results(comp.run_id)
    assert list(rebuilt) == ["baseline", "speculative", "speculative-2"]
    for engine, live in comp.results.items():
        assert [t.to_dict() for t in rebuilt[engine].tokens] == [t.to_dict() for t in live.tokens]
        assert rebuilt[engine].steps == live.steps and rebuilt[engine].output_text == live.output_text
        assert rebuilt[engine].metrics == live.metrics
    assert rebuilt["speculative-2"].method == "ngram"
    saved = history.engines(comp.run_id)
    assert [(e, r["label"], r["method"]) for e, r in saved.items()] == [
        ("baseline", "baseline", "none"), ("speculative", "draft dynamic K", "draft"),
        ("speculative-2", "n-gram", "ngram")]
    assert saved["speculative-2"]["comparison"]["identical"] is True
    assert saved["speculative-2"]["settings"]["method"] == "ngram"
    # one chart line per engine
    fig = charts.tokens_over_time(rebuilt["baseline"], rebuilt["speculative"], {"n-gram": rebuilt["speculative-2"]})
    assert [t.name for t in fig.data] == ["baseline", "speculative", "n-gram"]
    # where the time went: a row per engine, each with its passes' bars
    fig = charts.time_per_pass(rebuilt["baseline"], rebuilt["speculative"], {"n-gram": rebuilt["speculative-2"]})
    assert [a.text.split(":")[0] for a in fig.layout.annotations] == ["baseline", "speculative", "n-gram"]
    assert {t.yaxis for t in fig.data if t.name == "target pass"} == {"y", "y2", "y3"}
    # the replay shows every engine, with its label
    data = payload(history, comp.run_id)
    assert [(e["name"], e["label"]) for e in data["engines"]] == [
        ("baseline", "baseline"), ("speculative", "draft dynamic K"), ("speculative-2", "n-gram")]
    assert data["engines"][2]["final"]["speedup"] == saved["speculative-2"]["comparison"]["speedup"]
    # deleting the run deletes its engines
    history.delete([comp.run_id])
    assert history.engines(comp.run_id) == {}


def test_interrupted_nway_run_keeps_each_engines_streamed_output(backend, tmp_path):
    path = tmp_path / "h.db"
    history = History(path)
    base = Request(prompt="hello", max_new_tokens=10, drafting=Drafting(method="draft", k=2))
    comp = run_to_end(Comparison(backend, base, "fair", None, {}, extra=[variant(base, "n-gram", method="ngram")]))
    # the same run as a process killed after its last progress save would leave it
    from specconsole.history import EventLog

    run_id = history.start_run(mode="fair", prompt="hello", engines=comp.engine_rows())
    history.save_events(EventLog(run_id), comp.results)
    history.db.execute("UPDATE runs SET owner_pid = NULL WHERE id = ?", [run_id])  # its process is gone
    history.db.conn.commit()
    reopened = History(path)
    assert reopened.run(run_id)["status"] == "interrupted"
    saved = reopened.engines(run_id)
    assert saved["speculative-2"]["output"] == comp.results["speculative-2"].output_text
    rebuilt = reopened.results(run_id)
    assert list(rebuilt) == ["baseline", "speculative", "speculative-2"]
    assert rebuilt["speculative-2"].metrics.output_tokens == 10


def _old_history_module():
    """specconsole/history.py as it was before the engines table (git), to write a database the old way."""
    source = subprocess.run(["git", "show", "0a6e21a:specconsole/history.py"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    assert "engines" not in source.split("class EventLog")[0].split("EVENT_TABLES")[0]
    spec = importlib.util.spec_from_loader("old_history", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, "old_history.py", "exec"), module.__dict__)
    return module


def test_a_database_of_the_old_schema_opens_with_its_runs_intact(backend, tmp_path):
    old = _old_history_module()
    path = tmp_path / "old.db"
    old_history = old.History(path)
    req = Request(prompt="hello there", max_new_tokens=12, drafting=Drafting(method="draft", k=2))
    comp = Comparison(backend, req, "fair", None, {})
    run_to_end(comp)
    run_id = old_history.start_run(mode="fair", prompt=req.prompt, method="draft", category="chat")
    # the old code saved the metrics as a dict
    as_dicts = {e: replace(r, metrics=r.metrics.to_dict()) for e, r in comp.results.items()}
    saved_form = comp.comparison().to_dict() | comp.checks()["speculative"]  # the old code took the merged dict
    old_history.finish_run(run_id, "completed", as_dicts, saved_form)
    before = comp.results  # what the old code saved (its own reader knows only the step fields of its day)
    old_history.db.conn.close()
    assert "engines" not in sqlite_tables(path)

    history = History(path)  # the new code migrates it to its schema: the engines table holds both engines
    assert "engines" in sqlite_tables(path) and history.db.execute("PRAGMA user_version").fetchone()[0] == 2
    assert not {"baseline_output", "speculative_metrics"} & set(history.db["runs"].columns_dict)
    assert history.run(run_id)["status"] == "completed"
    saved = history.engines(run_id)
    assert list(saved) == ["baseline", "speculative"] and saved["speculative"]["method"] == "draft"
    assert saved["speculative"]["comparison"] == json.loads(json.dumps(saved_form))
    after = history.results(run_id)
    assert list(after) == ["baseline", "speculative"]
    for engine in before:
        # (the old code saved no runner-up and margin: unknown after)
        assert [t.to_dict() for t in after[engine].tokens] == [
            replace(t, runner_up=None, margin=None).to_dict() for t in before[engine].tokens]
        assert after[engine].output_text == before[engine].output_text
        assert after[engine].metrics == before[engine].metrics and after[engine].method == before[engine].method
    # and a new three-engine run sits beside it
    new = run_to_end(Comparison(backend, req, "fair", history, {"method": "draft"},
                                extra=[variant(req, "n-gram", method="ngram")]))
    assert list(history.results(new.run_id)) == ["baseline", "speculative", "speculative-2"]
    assert [r["id"] for r in history.runs()] == [new.run_id, run_id]
    # the CSVs cover both: the old run with its two engines, the new one with three
    _, _, engines_csv = export_all(history, tmp_path / "csv")
    rows = pd.read_csv(engines_csv)
    assert sorted(rows.groupby("run_id")["engine"].apply(list).to_dict().items()) == sorted(
        {run_id: ["baseline", "speculative"], new.run_id: ["baseline", "speculative", "speculative-2"]}.items())


def sqlite_tables(path) -> set[str]:
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        conn.close()


def test_csv_exports_have_every_engine(backend, tmp_path):
    history = History(tmp_path / "h.db")
    base = Request(prompt="hi", max_new_tokens=8, drafting=Drafting(method="draft", k=2))
    comp = run_to_end(Comparison(backend, base, "fair", history, {"method": "draft"},
                                 extra=from_presets(base, ["n-gram", "draft K=4 fixed"])))
    runs_csv, tokens_csv = export_csv(history, tmp_path / "csv")
    runs = pd.read_csv(runs_csv)
    assert runs.loc[0, "engines"] == "baseline,speculative,speculative-2,speculative-3"
    assert runs.loc[0, "speculative-2_label"] == "n-gram" and runs.loc[0, "speculative-3_method"] == "draft"
    assert runs.loc[0, "speculative-3_identical"] == 1
    tokens = pd.read_csv(tokens_csv, keep_default_na=False)
    assert list(dict.fromkeys(tokens["engine"])) == ["baseline", "speculative", "speculative-2", "speculative-3"]
    assert len(tokens) == sum(len(r.tokens) for r in comp.results.values())
    _, _, engines_csv = export_all(history, tmp_path / "csv2")
    engines = pd.read_csv(engines_csv)
    assert list(engines["engine"]) == ["baseline", "speculative", "speculative-2", "speculative-3"]
    assert list(engines["label"]) == ["baseline", "draft", "n-gram", "draft K=4 fixed"]
    assert engines["speedup"].isna().tolist() == [True, False, False, False]


def test_compare_specs_and_presets():
    base = Request(prompt="x", drafting=Drafting(method="draft", k=5, dynamic_k=True, draft_confidence=0.4,
                                                 draft_vocab=4096))
    v = parse_compare("draft, ngram,draft:k=4,hybrid:dynamic", base)
    assert [x.label for x in v] == ["draft", "n-gram", "draft K=4", "hybrid dynamic K"]
    assert [(x.request.drafting.method, x.request.drafting.k, x.request.drafting.dynamic_k) for x in v] == [
        ("draft", 5, True), ("ngram", 5, True), ("draft", 4, False), ("hybrid", 5, True)]
    assert v[1].request.drafting.draft_confidence == 0.0 and v[2].request.drafting.draft_confidence == 0.4
    assert [x.request.drafting.draft_vocab for x in v] == [4096, 0, 4096, 4096]  # n-gram drafting has no vocabulary
    assert all(x.request.prompt == "x" for x in v)
    from engine.limits import SettingsError

    for bad in ("", "eagle", "draft:k=x", "draft,ngram,hybrid,draft,ngram"):
        with pytest.raises(SettingsError):
            parse_compare(bad, base)
    assert [x.label for x in from_presets(base, ["hybrid", "n-gram"])] == ["n-gram", "hybrid"]  # PRESETS' order
    with pytest.raises(SettingsError):
        from_presets(base, list(PRESETS))  # four: one too many


def test_demo_compare_prints_the_nway_table(backend, monkeypatch, capsys):
    import launch
    from specconsole.host import ModelHost

    monkeypatch.setattr(backends, "local_host", lambda args: ModelHost("tiny", lambda progress: backend, "draft"))
    rc = launch.main(["demo", "--prompt", "hello there", "--max-new-tokens", "12", "--compare", "draft,ngram:k=3"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "== baseline ==" in out and "== speculative (draft) ==" in out and "== speculative-2 (n-gram K=3) ==" in out
    table = out[out.index("engine "):].splitlines()
    assert table[0].split() == ["engine", "label", "tokens/s", "speedup", "acceptance", "identical"]
    assert [line.split()[0] for line in table[1:4]] == ["baseline", "speculative", "speculative-2"]
    assert table[2].split()[-1] == "yes" and table[3].split()[-1] == "yes"


def test_the_page_has_hidden_panels_for_the_extra_engines(tmp_path):
    from specconsole.app import build
    from specconsole.host import ModelHost

    app = build(ModelHost("not loaded", lambda p: None), History(tmp_path / "h.db"))
    blocks = {getattr(b, "elem_id", None): b for b in app.blocks.values()}
    assert {"compare-with", "speculative-2-panel", "speculative-3-panel", "speculative-4-panel", "baseline-panel",
            "speculative-panel", "figures", "chart-tokens"} <= set(blocks)
    assert blocks["compare-with"].value == []  # by default the page runs two engines, as it always did
    for engine in ("speculative-2", "speculative-3", "speculative-4"):
        column = next(b for b in app.blocks.values() if blocks[f"{engine}-panel"] in getattr(b, "children", []))
        assert column.visible is False


def test_engines_table_escapes_labels_and_says_how_they_ran(backend):
    from specconsole.render import engines_html

    base = Request(prompt="hi", max_new_tokens=6, drafting=Drafting(method="draft", k=2))
    comp = run_to_end(Comparison(backend, base, "race", None, {}, extra=[variant(base, "<b>n</b>", method="ngram")]))
    html = engines_html(comp.results, comp.labels, comp.comparisons(), "race")
    assert "&lt;b&gt;n&lt;/b&gt;" in html and "<b>n" not in html
    assert html.count("<tr data-engine") == 3 and html.count("✔ identical") == 2
    assert "sharing the machine" in html


def test_history_tab_shows_the_extra_engines_of_a_saved_run(backend, tmp_path):
    from specconsole.tab_history import view

    history = History(tmp_path / "h.db")
    base = Request(prompt="hello", max_new_tokens=8, drafting=Drafting(method="draft", k=2))
    comp = run_to_end(Comparison(backend, base, "fair", history, {"method": "draft"},
                                 extra=[variant(base, "n-gram", method="ngram")]))
    row = history.run(comp.run_id)
    _, _, figures = view(history.results(comp.run_id), json.loads(row["comparison"]), "fair", True,
                         history.engines(comp.run_id))
    assert figures.count("<tr data-engine") == 3 and 'class="history-extra" data-engine="speculative-2"' in figures
    assert figures.count("✔ identical") == 3  # the main engine's line and two table rows


def test_vllm_compare_flag_describes_one_server_per_config():
    """`--vllm-compare ngram:k=2,ngram:k=6`: one --speculative-config per extra vLLM server; with --vllm-attach it
    must describe exactly the extra URLs (nothing is contacted before that is checked)."""
    import launch
    from engine.vllm.config import parse_configs
    from engine.vllm.server import VLLMError

    configs = parse_configs("ngram:k=2, ngram:k=6,draft_model:draft=/d")
    assert [(c["method"], c["num_speculative_tokens"]) for c in configs] == [("ngram", 2), ("ngram", 6),
                                                                             ("draft_model", 4)]
    assert configs[2]["model"] == "/d"
    with pytest.raises(VLLMError, match="unknown option"):
        parse_configs("ngram:q=1")
    urls = "http://127.0.0.1:9,http://127.0.0.1:9,http://127.0.0.1:9,http://127.0.0.1:9"
    with pytest.raises(SystemExit, match="describes 1 servers, --vllm-attach has 2 extra"):
        launch.main(["demo", "--backend", "vllm", "--prompt", "x", "--vllm-attach", urls,
                     "--vllm-compare", "ngram:k=2"])
    with pytest.raises(SystemExit, match="at most 3"):
        launch.main(["demo", "--backend", "vllm", "--prompt", "x", "--vllm-compare", "ngram,ngram,ngram,ngram"])
