"""What the page shows of a run (specconsole.render): tokens with model text escaped, provisional kinds marked,
rejected drafts hidden when asked, the figures, and the live panel's updates."""

from engine.events import TokenEvent, TokenKind
from specconsole.render import figures_html, token_span, tokens_html


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
    assert "provisional kinds right" in (html := figures_html(b, s, {}, "fair", None)) and "75%" in html
    s.metrics.provisional_accuracy = None
    assert "unknown" in figures_html(b, s, {}, "fair", None).split("provisional kinds right")[1][:80]
    local = RunResult("speculative", "draft", 0)
    assert "provisional" not in figures_html(None, local, {}, "fair", None)  # not a figure of the local backend


def test_the_servers_own_counters_stand_beside_the_run():
    """A server run's counters (engine.serving.counters): a disagreement flagged, an expected difference said, all
    text escaped; "unknown" where a server run has none; no row for our own engine, which has no server."""
    from engine.events import RunResult
    from engine.run_metrics import RunMetrics, ServerCounters

    label = "server&#x27;s own counters: drafted | accepted"
    s = RunResult("speculative", "llamacpp-draft", 0)
    s.metrics = RunMetrics(server={"drafted": 40, "accepted": 31},
                           server_counters=ServerCounters(10, 40, 33, expected_difference="a stop <b>cut</b> it"))
    value = figures_html(None, s, {}, "fair", None).split(label)[1][:200]
    assert "40 | 33" in value and "a stop &lt;b&gt;cut&lt;/b&gt; it" in value and "✖" not in value
    s.metrics.server_counters = ServerCounters(10, 40, 31, mismatch="the server counted <img src=x>")
    value = figures_html(None, s, {}, "fair", None).split(label)[1][:200]
    assert '<span class="exact diverged">✖ the server counted &lt;img src=x&gt;</span>' in value
    s.metrics.server_counters = None  # a llama-server started without --metrics
    assert figures_html(None, s, {}, "fair", None).split(label)[1][:60].count("unknown") == 1
    local = RunResult("speculative", "draft", 0)
    assert "counters" not in figures_html(None, local, {}, "fair", None)


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
