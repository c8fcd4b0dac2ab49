"""Suites, sweeps, aggregates and the advisor."""

import json
import threading
from statistics import median

import pandas as pd
import pytest

from engine.backend import Request
from specconsole.advisor import advise
from specconsole.history import History
from specconsole.report import write_csvs, write_html
from specconsole.suites import SuitePrompt, categories, load_file, load_suite
from specconsole.workbench import aggregate, request_for, run_suite, runs_frame

ITEMS = [SuitePrompt("code", "def add(a, b):"), SuitePrompt("code", "print('hello')"),
         SuitePrompt("chat", "hi there", 0.7, (("user", "hello"), ("assistant", "hi!")))]


def test_every_category_has_eight_prompts():
    assert {"code", "json_sql", "summarization", "multiturn", "creative", "chat"} <= set(categories())
    for c in categories():
        assert len(load_suite(c)) >= 8


def test_user_suites_from_jsonl_and_csv(tmp_path):
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a", "temperature": 0.5}) + "\n" + json.dumps({"prompt": "b", "category": "x"}))
    items = load_file(jsonl)
    assert [(i.category, i.prompt, i.temperature) for i in items] == [("mine", "a", 0.5), ("x", "b", 0.0)]
    csv = tmp_path / "other.csv"
    pd.DataFrame({"prompt": ["p1", "p2"], "category": ["c", None]}).to_csv(csv, index=False)
    assert [(i.category, i.prompt) for i in load_file(csv)] == [("c", "p1"), ("other", "p2")]
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt"}')
    with pytest.raises(ValueError, match="prompt"):
        load_file(tmp_path / "bad.jsonl")


def test_sweep_requests():
    base = Request(prompt="-", k=4)
    item = ITEMS[2]
    assert request_for(base, item).sampling.temperature == 0.7 and request_for(base, item).earlier_turns == item.earlier_turns
    assert request_for(base, item, "k", "8").k == 8 and request_for(base, item, "k", "dynamic").dynamic_k
    assert request_for(base, item, "temperature", "1.2", suite_temperature=False).sampling.temperature == 1.2
    assert request_for(base, item, "method", "ngram").method == "ngram"
    assert len(request_for(base, item, "context", "long").prompt) > 10 * len(item.prompt)


def test_suite_saves_every_run_and_aggregates_match(backend, tmp_path):
    history = History(tmp_path / "h.db")
    base = Request(prompt="-", max_new_tokens=12, method="draft", k=2)
    suite = run_suite(backend, ITEMS, base, history, {"backend": "local"}, variable="k", values=["1", "3"])
    assert len(suite.run_ids) == 6 and not suite.cancelled
    rows = history.runs(suite_id=suite.suite_id)
    assert len(rows) == 6 and {r["status"] for r in rows} == {"completed"}
    assert sorted(r["sweep_value"] for r in rows) == ["1", "1", "1", "3", "3", "3"]

    runs = runs_frame(history, suite.suite_id)
    agg = aggregate(runs)
    code_k3 = agg[(agg["category"] == "code") & (agg["sweep_value"] == "3")].iloc[0]
    stored = [json.loads(r["comparison"])["speedup"] for r in rows if r["category"] == "code" and r["sweep_value"] == "3"]
    assert code_k3["runs"] == 2 and code_k3["speedup"] == pytest.approx(median(stored))
    assert code_k3["speedup_min"] == pytest.approx(min(stored)) and code_k3["identical"] == "2/2"

    paths = write_csvs(runs, agg, tmp_path / "out" / f"suite_{suite.suite_id}.csv")
    assert len(pd.read_csv(paths[0])) == 6 and len(pd.read_csv(paths[1])) == 4
    html = write_html(agg, advise(agg, "k"), tmp_path / "r.html", suite.suite_id).read_text()
    # plotly.js is embedded, not fetched: the report works offline
    assert "Advice" in html and "Plotly.newPlot" in html and len(html) > 1_000_000
    assert '<script src="http' not in html and "<script src='http" not in html


def test_cancel_keeps_completed_runs(backend, tmp_path):
    history = History(tmp_path / "h.db")
    cancel = threading.Event()
    done = []

    def progress(i, total, what):
        done.append(i)
        if i == 2:
            cancel.set()

    suite = run_suite(backend, ITEMS * 2, Request(prompt="-", max_new_tokens=8, k=2), history, {}, cancel=cancel,
                      on_progress=progress)
    assert suite.cancelled and len(suite.run_ids) == 2
    assert [r["status"] for r in history.runs(suite_id=suite.suite_id)] == ["completed", "completed"]


def agg_rows(*rows):
    base = {"sweep_value": "", "runs": 5, "speedup_min": 0.0, "speedup_max": 9.0, "mean_accepted_length": 2.0,
            "prefill_share": 0.1, "per_position": []}
    return pd.DataFrame([base | r for r in rows])


def test_advisor_low_acceptance_says_dont():
    [a] = advise(agg_rows({"category": "creative", "speedup": 0.9, "acceptance": 0.3}))
    assert a.verdict == "don't" and a.expected_speedup is None
    text = " ".join(a.reasons)
    assert "0.90x" in text and "acceptance 0.30" in text


def test_advisor_marginal_gain_with_poor_drafts_says_dont_and_good_gain_overrides():
    [a] = advise(agg_rows({"category": "chat", "speedup": 1.1, "acceptance": 0.3}))
    assert a.verdict == "don't" and any("acceptance 0.30 is below 0.4" in r for r in a.reasons)
    [b] = advise(agg_rows({"category": "rag", "speedup": 1.4, "acceptance": 0.3}))  # cheap n-gram drafts
    assert b.verdict == "enable" and any("acceptance 0.30 is low" in r for r in b.reasons)
    [c] = advise(agg_rows({"category": "chat", "speedup": 1.1, "acceptance": 0.7}))
    assert c.verdict == "enable with these settings" and "K" in c.settings


def test_advisor_enables_structured_output():
    [a] = advise(agg_rows({"category": "code", "speedup": 2.1, "acceptance": 0.85}))
    assert a.verdict == "enable" and a.expected_speedup == pytest.approx(2.1) and "2.10x" in a.reasons[0]


def test_advisor_recommends_the_better_sweep_value():
    rows = agg_rows({"category": "code", "sweep_value": "4", "speedup": 1.5, "acceptance": 0.8},
                    {"category": "code", "sweep_value": "8", "speedup": 2.0, "acceptance": 0.8})
    [a] = advise(rows, "k", default_value="4")
    assert a.verdict == "enable with these settings" and a.settings == {"k": "8"}
    assert any("2.00x against 1.50x" in r for r in a.reasons)


def test_memory_figures_of_a_backend(backend):
    memory = backend.memory()
    assert memory["target_gb"] > 0 and memory["draft_gb"] > 0 and memory["available_gb"] > memory["needed_gb"]
    [a] = advise(agg_rows({"category": "code", "speedup": 2.0, "acceptance": 0.8}), memory=memory)
    assert a.verdict == "enable" and any("fit in" in r for r in a.reasons)


def test_advisor_memory_and_prefill_and_concurrency():
    rows = agg_rows({"category": "rag", "speedup": 1.6, "acceptance": 0.7, "prefill_share": 0.7})
    [a] = advise(rows, memory={"needed_gb": 30.0, "available_gb": 24.0, "draft_gb": 2.0})
    assert a.verdict == "don't" and any("24.0 GB are available" in r for r in a.reasons)
    assert any("prefill takes 70%" in r for r in a.reasons)
    conc = pd.DataFrame({"concurrency": [1, 4, 16], "speedup": [1.8, 1.2, 0.8]})
    [b] = advise(rows, concurrency=conc)
    assert b.verdict == "enable"
    assert any("pays up to 4 concurrent requests (1.20x)" in r for r in b.reasons)
    assert any("at 16 concurrent requests it gives 0.80x" in r for r in b.reasons)
