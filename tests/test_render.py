"""What the page shows of a run (specconsole.render): tokens with model text escaped, provisional kinds marked,
rejected drafts hidden when asked, the figures, the live panel's updates, and where the time went
(specconsole.charts)."""

import pytest

from engine.comparison import ComparisonFigures
from engine.events import RunResult, StepRecord, TokenEvent, TokenKind
from specconsole import charts
from specconsole.render import figures_html, token_span, tokens_html

UNKNOWN = ComparisonFigures()  # no comparison figure known: these tests look at the runs' own


def test_tokens_are_escaped():
    evil = TokenEvent(TokenKind.ACCEPTED, 1, '<script>alert("x")</script>', 1, 0, 0.1, 0, 0.5, 0.25)
    html = token_span(evil)
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert 'class="tok accepted"' in html and "p(target) = 0.500" in html and "q(draft) = 0.250" in html
    rejected = token_span(TokenEvent(TokenKind.REJECTED, 2, "a&b", 1, 1, 0.1))
    assert rejected.startswith("<del") and "a&amp;b" in rejected
    assert "&lt;b&gt;" in tokens_html([], error="<b>bad</b>")


def test_provisional_tokens_are_marked_and_escaped():
    """A vLLM token whose kind is a guess from chunk boundaries: its own class and a note in the tooltip, model text
    escaped; once confirmed (provisional cleared) neither is left."""
    guess = TokenEvent(TokenKind.BONUS, 7, '<img src=x onerror="y">', 2, 3, 0.2, 5, provisional=True)
    html = token_span(guess)
    assert "<img" not in html and "&lt;img src=x onerror=&quot;y&quot;&gt;" in html
    assert 'class="tok bonus provisional"' in html and "provisional: from chunk boundaries" in html
    guess.provisional = False
    assert 'class="tok bonus"' in token_span(guess) and "chunk boundaries" not in token_span(guess)


def test_provisional_accuracy_is_a_vllm_figure():
    from engine.events import RunResult
    from engine.run_metrics import RunMetrics

    b, s = RunResult("baseline", "none", 0), RunResult("speculative", "ngram", 0)
    b.metrics = RunMetrics(server={"time_to_first_token_ms": 5.0})
    s.metrics = RunMetrics(server={"time_to_first_token_ms": 4.0}, provisional_accuracy=0.75, output_tokens=12)
    assert "provisional kinds right" in (html := figures_html(b, s, UNKNOWN, "fair", None)) and "75%" in html
    s.metrics.provisional_accuracy = None
    assert "unknown" in figures_html(b, s, UNKNOWN, "fair", None).split("provisional kinds right")[1][:80]
    local = RunResult("speculative", "draft", 0)
    assert "provisional" not in figures_html(None, local, UNKNOWN, "fair", None)  # not a figure of the local backend


def test_the_servers_own_counters_stand_beside_the_run():
    """A server run's counters (engine.serving.counters): a disagreement flagged, an expected difference said, all
    text escaped; "unknown" where a server run has none; no row for our own engine, which has no server."""
    from engine.events import RunResult
    from engine.run_metrics import RunMetrics, ServerCounters

    label = "server&#x27;s own counters: drafted | accepted"
    s = RunResult("speculative", "llamacpp-draft", 0)
    s.metrics = RunMetrics(server={"drafted": 40, "accepted": 31},
                           server_counters=ServerCounters(10, 40, 33, expected_difference="a stop <b>cut</b> it"))
    value = figures_html(None, s, UNKNOWN, "fair", None).split(label)[1][:200]
    assert "40 | 33" in value and "a stop &lt;b&gt;cut&lt;/b&gt; it" in value and "✖" not in value
    s.metrics.server_counters = ServerCounters(10, 40, 31, mismatch="the server counted <img src=x>")
    value = figures_html(None, s, UNKNOWN, "fair", None).split(label)[1][:200]
    assert '<span class="exact diverged">✖ the server counted &lt;img src=x&gt;</span>' in value
    s.metrics.server_counters = None  # a llama-server started without --metrics
    assert figures_html(None, s, UNKNOWN, "fair", None).split(label)[1][:60].count("unknown") == 1
    local = RunResult("speculative", "draft", 0)
    assert "counters" not in figures_html(None, local, UNKNOWN, "fair", None)


def test_rejected_drafts_can_be_hidden():
    toks = [TokenEvent(TokenKind.ACCEPTED, 1, "x", 1, 0, 0.1, 0), TokenEvent(TokenKind.REJECTED, 2, "y", 1, 1, 0.1)]
    assert "rejected" in tokens_html(toks, show_rejected=True)
    assert "rejected" not in tokens_html(toks, show_rejected=False)


def _tok(kind: TokenKind, text: str, index: int) -> TokenEvent:
    return TokenEvent(kind, index, text, 1, index, 0.1, index)


def test_live_panel_sends_only_new_tokens():
    """Each update carries the tokens the page has not got yet; a re-classification re-sends the panel once."""
    import json

    from specconsole.render import PanelFeed

    feed = PanelFeed("run1")
    toks = [_tok(TokenKind.PENDING, "<b>", 0), _tok(TokenKind.PENDING, "x", 1)]
    first = json.loads(feed.message(toks, "running…"))
    assert first["start"] == 0 and len(first["tokens"]) == 2 and not first["reset"]
    assert "&lt;b&gt;" in first["tokens"][0] and "<b>" not in first["tokens"][0]
    assert feed.message(toks, "running…") is None  # nothing new: no message at all
    toks.append(_tok(TokenKind.PENDING, "y", 2))
    second = json.loads(feed.message(toks, "running…"))
    assert second["start"] == 2 and len(second["tokens"]) == 1 and second["total"] == 3
    # the end of a vLLM request classifies the pending tokens: the panel is re-sent once, from the start
    done = [_tok(TokenKind.ACCEPTED, t.text, i) for i, t in enumerate(toks)]
    final = json.loads(feed.message(done, "length · 3 tokens", final=True))
    assert final["reset"] and final["start"] == 0 and len(final["tokens"]) == 3
    assert final["final_html"] == "".join(final["tokens"])


def test_live_panel_hides_rejected_drafts_when_asked():
    import json

    from specconsole.render import PanelFeed

    toks = [_tok(TokenKind.ACCEPTED, "a", 0), _tok(TokenKind.REJECTED, "b", 1), _tok(TokenKind.RECOVERED, "c", 2)]
    shown = json.loads(PanelFeed("r", show_rejected=False).message(toks))
    assert shown["total"] == 2 and not any("rejected" in t for t in shown["tokens"])
    assert json.loads(PanelFeed("r").message(toks))["total"] == 3


def test_time_per_pass_stacks_each_pass_and_says_where_the_split_is_unknown():
    """A stacked bar per target pass, spanning it on the run's clock: drafting, the pass, and the rest of the time
    since the previous step ended (clamped at 0 where the timers exceed it); one row per engine. A server's steps
    carry no timings: its row says the split is unknown and draws nothing."""
    base = RunResult("baseline", "none", 3)
    base.steps = [StepRecord(i, 0, 0, 1, 0.0, 10.0, 0.012 * (i + 1)) for i in range(4)]  # 12 ms apart
    spec = RunResult("speculative", "draft", 3)
    spec.steps = [StepRecord(0, 0, 0, 1, 0.0, 20.0, 0.025),  # the prefill: 25 ms since the start
                  StepRecord(1, 3, 2, 3, 6.0, 15.0, 0.050),  # 25 ms
                  StepRecord(2, 3, 3, 4, 6.0, 15.0, 0.060)]  # 10 ms, 21 of them timed: other clamps at 0
    server = RunResult("speculative-2", "ngram", 3)
    server.steps = [StepRecord(0, 0, 0, 1, 0.0, 0.0, 0.1), StepRecord(1, 3, 2, 3, 0.0, 0.0, 0.2)]
    fig = charts.time_per_pass(base, spec, {"<b>server</b>": server})

    bars = {(t.yaxis, t.name): t for t in fig.data}
    # the baseline drafts nothing, so it has no drafting trace; the server's row has no trace at all
    assert list(bars) == [("y", "target pass"), ("y", "other"),
                          ("y2", "drafting"), ("y2", "target pass"), ("y2", "other")]
    assert bars["y", "target pass"].y == (10.0,) * 4 and bars["y", "other"].y == pytest.approx((2.0,) * 4)
    assert bars["y2", "drafting"].y == (0.0, 6.0, 6.0) and bars["y2", "target pass"].y == (20.0, 15.0, 15.0)
    assert bars["y2", "other"].y == pytest.approx((5.0, 4.0, 0.0))
    assert bars["y2", "other"].x == pytest.approx((0.0125, 0.0375, 0.055))
    assert bars["y2", "other"].width == pytest.approx((0.025, 0.025, 0.01))
    assert fig.layout.barmode == "stack" and [t.name for t in fig.data if t.showlegend] == [
        "target pass", "other", "drafting"]  # each part named once in the legend
    assert [a.text for a in fig.layout.annotations] == [
        "baseline: 4 target passes, the first (reading the prompt) 12 ms",
        "speculative: 3 target passes, the first (reading the prompt) 25 ms",
        "&lt;b&gt;server&lt;/b&gt;: 2 target passes, split unknown (the engine does not time drafting and verifying "
        "apart)"]
    # one scale for all rows: the passes after each engine's first (the speculative engine's 6 + 15 + 4 ms)
    assert fig.layout.yaxis.range == pytest.approx((0, 1.05 * 25))
    assert fig.layout.yaxis.matches == fig.layout.yaxis2.matches == "y3"  # the bottom row's
    # a run with no steps yet is not unknown, only empty
    fig = charts.time_per_pass(RunResult("baseline", "none", 3), None)
    assert not fig.data and [a.text for a in fig.layout.annotations] == ["baseline: 0 target passes"]


def test_time_per_pass_averages_a_long_runs_passes():
    """Plotly draws every bar on every update: past MAX_BARS passes, a bar is the mean of consecutive passes and
    spans their time, and the row says so."""
    passes = [(0.0, 1.0, 1.0, 10.0, 1.0), (1.0, 2.0, 2.0, 20.0, 2.0), (2.0, 3.0, 3.0, 30.0, 0.0),
              (3.0, 4.0, 4.0, 40.0, 4.0), (4.0, 5.0, 5.0, 50.0, 5.0)]
    assert charts.grouped(passes, most=2) == (3, [(0.0, 3.0, 2.0, 20.0, 1.0), (3.0, 5.0, 4.5, 45.0, 4.5)])
    assert charts.grouped(passes, most=5) == (1, passes)
    run = RunResult("speculative", "draft", 3)
    run.steps = [StepRecord(i, 2, 1, 2, 1.0, 4.0, 0.01 * (i + 1)) for i in range(2 * charts.MAX_BARS + 1)]
    fig = charts.time_per_pass(None, run)
    assert [len(t.y) for t in fig.data] == [134] * 3 and fig.data[2].y == pytest.approx((5.0,) * 134)  # 401 / 3
    assert fig.data[0].x[-1] == pytest.approx((3.99 + 4.01) / 2) and fig.data[0].width[-1] == pytest.approx(0.02)
    assert fig.layout.annotations[0].text == ("speculative: 401 target passes, the first (reading the prompt) 10 ms, "
                                              "each bar the mean of 3")


def test_the_histogram_before_any_step_is_a_dash_and_unknown_where_not_known(caplog):
    """A speculative run that has no step yet (the page's first update) has an empty histogram: "–", not a list shown
    as a number; a backend that cannot count them says unknown."""
    from engine.run_metrics import RunMetrics

    s = RunResult("speculative", "draft", 0)
    s.metrics = RunMetrics(acceptance_histogram=[])
    value = figures_html(None, s, UNKNOWN, "fair", None).split("drafts accepted per step")[1][:80]
    assert "–" in value and "?" not in value and "not a number" not in caplog.text
    s.metrics.acceptance_histogram = None
    assert "unknown" in figures_html(None, s, UNKNOWN, "fair", None).split("drafts accepted per step")[1][:80]
