"""Why a greedy run parted from the baseline: each engine records the target's runner-up and logit margin at
every output token (engine.exact.sampling.runners_up), and the comparison, the figures, the CSVs and the workbench
show them at the first divergence (engine.metrics.near_tie)."""

from dataclasses import replace

import pandas as pd
import pytest

from engine.events import RunResult, TokenEvent, TokenKind
from engine.exact.forward import forward, new_cache
from engine.metrics import compare, run_metrics
from specconsole.advisor import _identity
from specconsole.export import export_all
from specconsole.history import History
from specconsole.render import figures_html
from specconsole.replay import payload
from specconsole.workbench import aggregate, runs_frame
from engine.stops import StopConditions
from tests.test_greedy_exact import PROMPT, baseline, draft_proposer, fixed, speculative


def independent_runners_up(model, prompt: list[int], out: list[int]) -> list[tuple[int, float]]:
    """The target's runner-up and margin before each output token, from one plain pass over the whole sequence."""
    logits = forward(model, prompt + out[:-1], new_cache(model), keep=len(out))
    top = logits.float().topk(2, dim=-1)
    return list(zip(top.indices[:, 1].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()))


def test_both_engines_record_the_targets_runner_up_at_every_output_token(tiny_pair, smol_tokenizer):
    target, draft = tiny_pair
    stops = StopConditions(40)
    b = baseline(target, smol_tokenizer, PROMPT, stops)
    s = speculative(target, smol_tokenizer, draft_proposer(draft, target), PROMPT, stops, fixed(4))
    assert s.output_ids == b.output_ids
    expected = independent_runners_up(target, PROMPT, b.output_ids)
    for run in (b, s):
        got = [(t.runner_up, t.margin) for t in run.output_tokens]
        assert [r for r, _ in got] == [r for r, _ in expected], run.engine
        assert [m for _, m in got] == pytest.approx([m for _, m in expected], abs=1e-4), run.engine
    assert all(t.runner_up is None for t in s.tokens if t.kind == TokenKind.REJECTED)


def _run(engine: str, tokens: list[tuple[int, str, int | None, float | None]]) -> RunResult:
    r = RunResult(engine, "none" if engine == "baseline" else "draft", 3, finish_reason="length")
    r.tokens = [TokenEvent(TokenKind.BASELINE, i, text, n, 0, 0.1 * (n + 1), n, runner_up=up, margin=m)
                for n, (i, text, up, m) in enumerate(tokens)]
    r.output_ids = [t.token_id for t in r.tokens]
    r.total_s = 0.5
    r.metrics = run_metrics(r)
    return r


def planted_pair(margins=(0.004, 0.001)) -> tuple[RunResult, RunResult]:
    """Two greedy runs that agree on 'A' and part at token 1: the plain pass put '<b>' over 'c' by a hair, the
    speculative engine's pass 'c' over '<b>'."""
    b = _run("baseline", [(1, "A", 9, 0.5), (2, "<b>", 3, margins[0]), (4, "x", 5, 0.2)])
    s = _run("speculative", [(1, "A", 9, 0.5), (3, "c", 2, margins[1]), (4, "x", 5, 0.2)])
    return b, s


def test_a_planted_near_tie_is_shown_at_the_first_divergence():
    b, s = planted_pair()
    c = compare(b, s, greedy=True)
    assert c.first_divergence == 1 and c.divergence_margin == 0.004
    assert c.near_tie == {
        "baseline": {"token": 2, "text": "<b>", "runner_up": 3, "runner_up_text": "c", "margin": 0.004},
        "speculative": {"token": 3, "text": "c", "runner_up": 2, "runner_up_text": "<b>", "margin": 0.001}}
    html = figures_html(b, s, c, "fair", None)
    assert "the plain pass chose &#x27;&lt;b&gt;&#x27; over &#x27;c&#x27; by 0.004;" in html
    assert "the speculative engine&#x27;s pass chose &#x27;c&#x27; over &#x27;&lt;b&gt;&#x27; by 0.001 (logits" in html
    assert "<b>" not in html.split("near-tie")[1]  # the token's text is escaped
    # a backend that records no runner-up (a server): unknown, not guessed
    for t in s.tokens:
        t.margin = t.runner_up = None
    c = compare(b, s, greedy=True)
    assert c.near_tie is None and c.divergence_margin is None
    assert "why: unknown" in figures_html(b, s, c, "fair", None)
    assert compare(b, b, greedy=True).near_tie is None  # identical: nothing to explain


def test_a_runner_up_named_by_text_is_shown_saved_and_replayed(tmp_path):
    """vLLM's top-2 logprobs name the runner-up by its text, not its id: the evidence, the page, the history and the
    replay keep that text, escaped on the page; half an emoji (a lone surrogate) is saved as U+FFFD."""
    b, s = planted_pair()
    b.tokens[1] = replace(b.tokens[1], runner_up=None, runner_up_text="c")
    s.tokens[1] = replace(s.tokens[1], runner_up=None, runner_up_text="<b>")
    s.tokens[0] = replace(s.tokens[0], runner_up=None, runner_up_text="\ud83d")
    c = compare(b, s, greedy=True)
    assert c.near_tie["baseline"] == {"token": 2, "text": "<b>", "runner_up": None, "runner_up_text": "c",
                                         "margin": 0.004}
    assert c.near_tie["speculative"]["runner_up_text"] == "<b>" and c.divergence_margin == 0.004
    html = figures_html(b, s, c, "fair", None)
    assert "the speculative engine&#x27;s pass chose &#x27;c&#x27; over &#x27;&lt;b&gt;&#x27; by 0.001 (logits" in html
    history = History(tmp_path / "h.db")
    run_id = history.start_run(category="chat", prompt="p", suite_id="", sweep_variable="", sweep_value="",
                               method="ngram", repeat=0)
    history.finish_run(run_id, "completed", {"baseline": b, "speculative": s}, c)
    saved = history.results(run_id)
    assert [t.runner_up_text for t in saved["speculative"].tokens] == ["\ufffd", "<b>", None]
    assert compare(saved["baseline"], saved["speculative"], greedy=True).near_tie == c.near_tie
    assert "chose 'c' over '<b>' by 0.001" in payload(history, run_id)["near_tie"]


def test_the_csvs_and_the_workbench_count_divergences_with_their_margins(tmp_path):
    """Three greedy runs of one category: two part from the baseline (margins 0.01 and 0.03 in the plain pass),
    one does not; the workbench counts 2 divergences with the median margin 0.02, and the CSVs carry each margin."""
    history = History(tmp_path / "h.db")
    for margin in (0.01, 0.03, None):
        b, s = planted_pair((margin or 0.004, 0.001))
        if margin is None:  # this one did not part
            s = _run("speculative", [(t.token_id, t.text, t.runner_up, t.margin) for t in b.tokens])
        run_id = history.start_run(category="code", prompt=f"p{margin}", suite_id="s1", sweep_variable="",
                                   sweep_value="", method="draft", repeat=0)
        history.finish_run(run_id, "completed", {"baseline": b, "speculative": s}, compare(b, s, greedy=True))
    parted = history.runs(suite_id="s1")[-1]["id"]  # the first saved: margin 0.01
    assert payload(history, parted)["near_tie"].startswith("near-tie? the plain pass chose '<b>' over 'c' by 0.01;")
    row = aggregate(runs_frame(history, "s1")).iloc[0]
    assert row["identical"] == "1/3" and row["divergences"] == 2 and row["divergence_margin"] == pytest.approx(0.02)
    assert "where it parted, the plain pass's best token led its runner-up by 0.02 logits (median)" in _identity(row)[0]
    runs_csv, tokens_csv, engines_csv = export_all(history, tmp_path / "csv")
    engines = pd.read_csv(engines_csv)
    margins = engines[engines["engine"] == "speculative"]["divergence_margin"]
    assert sorted(margins.dropna()) == pytest.approx([0.01, 0.03]) and margins.isna().sum() == 1
    assert sorted(pd.read_csv(runs_csv)["speculative_divergence_margin"].dropna()) == pytest.approx([0.01, 0.03])
    tokens = pd.read_csv(tokens_csv)
    assert {"runner_up", "margin"} <= set(tokens) and tokens["margin"].notna().all()

