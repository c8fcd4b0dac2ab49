"""The replay export: one saved run as a self-contained HTML file, played back offline in a real Chromium."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from engine.events import RunResult, StepRecord, TokenEvent, TokenKind
from engine.metrics import compare, run_metrics
from engine.drafting import Drafting
from engine.request import Request
from specconsole.history import History
from specconsole.replay import UnknownRun, payload, replay_html, write_replay
from specconsole.runner import Comparison
from tests.conftest import run_to_end

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
EVIL = "<script>alert(1)</script>"
DATA = re.compile(r'<script id="replay-data" type="application/json">(.*?)</script>', re.S)


def constructed_run(history: History, texts: list[str], error: str | None = None) -> str:
    """A finished run built by hand (no model): the baseline emits `texts`, the speculative engine the same text
    in two steps, with one rejected draft."""
    b = RunResult("baseline", "none", 3)
    b.tokens = [TokenEvent(TokenKind.BASELINE, i, s, i, 0, 0.1 * (i + 1), i) for i, s in enumerate(texts)]
    b.steps = [StepRecord(i, 0, 0, 1, 0.0, 100.0, 0.1 * (i + 1)) for i in range(len(texts))]
    s = RunResult("speculative", "draft", 3)
    kinds = [TokenKind.BASELINE] + [TokenKind.ACCEPTED] * (len(texts) - 2) + [TokenKind.RECOVERED]
    s.tokens = [TokenEvent(k, i, t, 0 if i == 0 else 1, 0 if i == 0 else i - 1, 0.05 if i == 0 else 0.15, i, 0.9, 0.8)
                for i, (k, t) in enumerate(zip(kinds, texts))]
    s.tokens.append(TokenEvent(TokenKind.REJECTED, 99, "&nope", 1, len(texts) - 1, 0.15, None, 0.1, 0.7))
    s.steps = [StepRecord(0, 0, 0, 1, 0.0, 50.0, 0.05), StepRecord(1, len(texts) - 1, len(texts) - 2, len(texts) - 1,
                                                                   20.0, 80.0, 0.15)]
    s.error = error
    for r in (b, s):
        r.output_text = "".join(texts)
        r.output_ids = [t.token_id for t in r.output_tokens]
        r.total_s = max(t.time_s for t in r.tokens)
        r.finish_reason = "length"
        r.metrics = run_metrics(r)
    run_id = history.start_run(prompt="</script><!-- prompt & <b>", category="chat", method="draft", mode="fair")
    history.finish_run(run_id, "completed", {"baseline": b, "speculative": s}, compare(b, s, greedy=True))
    return run_id


def test_payload_is_escaped_for_a_script_element(tmp_path):
    history = History(tmp_path / "h.db")
    texts = ["Hi", EVIL, "</script><script>alert(2)</script>", "a & b", "<!--", "\u2028", "x\u202ey", ""]
    run_id = constructed_run(history, texts)
    html = replay_html(history, run_id)

    body = DATA.search(html).group(1)
    # nothing in the data can close or alter the element it sits in
    assert not set("<>&") & set(body)
    data = json.loads(body)
    assert data == json.loads(json.dumps(payload(history, run_id)))
    assert [e["name"] for e in data["engines"]] == ["baseline", "speculative"]
    fields = data["token_fields"]
    spec = data["engines"][1]
    assert [t[fields.index("text")] for t in spec["tokens"]] == texts + ["&nope"]
    assert data["run"]["prompt"] == "</script><!-- prompt & <b>"
    # the one bidi-override token is isolated; the tooltips are the console's
    assert [t[fields.index("isolate")] for t in spec["tokens"]].count(1) == 1
    assert spec["tokens"][1][fields.index("title")] == "accepted, step 1, position 0, token id 1, p(target) = 0.900, q(draft) = 0.800"
    # the page itself: exactly two scripts (data and player), nothing it could fetch
    assert html.count("<script") == 2 and html.count("</script>") == 2
    assert not re.search(r"\b(src|href)\s*=|@import|url\(", html, re.I)
    assert "default-src 'none'" in html


def test_unknown_run_and_cli(tmp_path, caplog):
    import launch

    history = History(tmp_path / "h.db")
    run_id = constructed_run(history, ["a", "b", "c"])
    with pytest.raises(UnknownRun):
        replay_html(history, "nope")
    out = tmp_path / "out" / "replay.html"
    assert launch.main(["replay", "nope", "--out", str(out), "--db", str(tmp_path / "h.db")]) == 2
    assert "no run 'nope'" in caplog.text and not out.exists()
    assert launch.main(["replay", run_id, "--out", str(out), "--db", str(tmp_path / "missing.db")]) == 2
    assert not (tmp_path / "missing.db").exists()  # a wrong --db path does not create an empty history
    assert launch.main(["replay", run_id, "--out", str(out), "--db", str(tmp_path / "h.db")]) == 0
    assert out.read_text(encoding="utf-8") == replay_html(history, run_id)


# --- a real run, replayed in Chromium --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def close_backend(smol_tokenizer):
    """conftest's tiny target with a draft much closer to it than conftest's: on this vocabulary conftest's draft
    is never accepted, and the replay should show every kind (accepted, rejected, recovered, bonus)."""
    from engine.exact.backend import LocalBackend
    from engine.exact.models import LoadedModel
    from engine.exact.optimize import prepare_draft, prepare_target
    from tests.conftest import CPU, perturbed, tiny_llama

    target = tiny_llama(len(smol_tokenizer), seed=3)
    draft = perturbed(target, 0.02, seed=4)  # before prepare_target, which makes the weights opaque
    return LocalBackend(LoadedModel("tiny", prepare_target(target, CPU), smol_tokenizer, CPU),
                        LoadedModel("tiny-draft", prepare_draft(draft, CPU, int8=False), smol_tokenizer, CPU))


@pytest.fixture(scope="module")
def real_run(close_backend, tmp_path_factory):
    """A real comparison with the tiny model, saved in a real History; then one accepted token's text made into
    markup in the database, as a hostile model output would be."""
    path = tmp_path_factory.mktemp("replay") / "history.db"
    history = History(path)
    req = Request(prompt="Write <b>bold</b> & more", max_new_tokens=40, drafting=Drafting(method="draft", k=3))
    comp = run_to_end(Comparison(close_backend, req, "fair", history, {"category": "chat", "backend": "local",
                                                                 "method": "draft"}))
    assert comp.status == "completed"
    seq = history.db.execute("SELECT min(seq) FROM tokens WHERE run_id = ? AND engine = 'speculative' AND "
                             "kind = 'accepted'", [comp.run_id]).fetchone()[0]
    assert seq is not None, "the tiny draft had no accepted token"
    with history.db.conn:
        history.db.execute("UPDATE tokens SET text = ? WHERE run_id = ? AND engine = 'speculative' AND seq = ?",
                           [EVIL, comp.run_id, seq])
    return history, comp.run_id


def time_bars(page) -> dict:
    """Per engine, the bars the replay's time chart shows (one per target pass)."""
    return page.eval_on_selector_all("#chart-time g[data-engine]", "gs => Object.fromEntries(gs.map(g => "
                                     "[g.dataset.engine, g.children.length]))")


PANEL_STATE = """() => [...document.querySelectorAll('.tokens')].map(box => ({
    engine: box.dataset.engine,
    kinds: [...box.querySelectorAll('.tok')].map(t => t.classList[1]),
    text: [...box.querySelectorAll('.tok:not(.rejected)')].map(t => 'empty' in t.dataset ? '' : t.textContent).join(''),
    elements: box.querySelectorAll('*').length,
    scripts: box.querySelectorAll('script').length,
}))"""


def test_replay_in_chromium_offline(real_run, browser, tmp_path):
    history, run_id = real_run
    out = write_replay(history, run_id, tmp_path / "replay.html")
    url = out.as_uri()

    context = browser.new_context(viewport={"width": 1400, "height": 1600})
    page = context.new_page()
    requests, blocked, dialogs, errors = [], [], [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.on("pageerror", lambda e: errors.append(str(e)))

    def route(r):  # the file itself may load; anything else is counted and refused
        if r.request.url == url:
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    # the page's clock, and so its animation frames, move only when the test moves it: the replay is deterministic
    page.clock.install(time=0)
    page.clock.pause_at(1000)
    page.goto(url)
    page.wait_for_selector("body[data-state='paused']")
    assert page.locator(".tokens .tok").count() == 0  # time 0: nothing streamed yet

    results = history.results(run_id)
    data = payload(history, run_id)
    duration = data["duration"]
    time_now = lambda: float(page.get_attribute("body", "data-time"))  # noqa: E731

    # scrub to the middle: each panel shows exactly the tokens recorded up to then
    page.evaluate("v => { const s = document.getElementById('scrub'); s.value = v; s.dispatchEvent(new Event('input')); }", 500)
    middle = time_now()
    assert middle == pytest.approx(duration / 2, abs=1e-3)
    shown = {e["name"]: page.locator(f".tokens[data-engine='{e['name']}'] .tok").count() for e in data["engines"]}
    assert shown == {e["name"]: sum(t[2] <= middle for t in e["tokens"]) for e in data["engines"]}
    assert all(shown.values()) and sum(shown.values()) < sum(len(e["tokens"]) for e in data["engines"])
    figures_then = page.inner_text("#figures")  # counting up: live figures, no exactness verdict yet
    # where the time went: a stacked bar per target pass recorded up to then
    assert time_bars(page) == {e["name"]: sum(s[3] <= middle for s in e["steps"]) for e in data["engines"]}
    assert "identical" not in figures_then and re.search(r"\d\.\d\d \| \d+\.\d\d", figures_then)

    # play from the start at 4x to the end
    page.keyboard.press("Home")
    page.select_option("#speed", "4")
    page.evaluate("document.activeElement.blur()")  # the keys go to the page, not the speed menu
    page.clock.run_for(int(duration * 1000 / 4) + 500)
    assert page.get_attribute("body", "data-state") == "ended" and time_now() == pytest.approx(duration, abs=1e-3)

    state = {p["engine"]: p for p in page.evaluate(PANEL_STATE)}
    assert set(state) == {"baseline", "speculative"}
    for engine, r in results.items():
        shown = state[engine]
        assert len(shown["kinds"]) == len(r.tokens)
        assert Counter(shown["kinds"]) == Counter(t.kind.value for t in r.tokens)
        assert shown["text"] == "".join(t.text for t in r.output_tokens)
        assert shown["scripts"] == 0 and shown["elements"] == len(r.tokens)  # one element per token, no more
    assert {"accepted", "rejected", "recovered", "bonus"} <= set(state["speculative"]["kinds"])
    assert page.locator(".panel-error:visible").count() == 0
    assert page.locator(".panel-status").all_inner_texts() == [f"completed · {len(results[e].output_tokens)} tokens"
                                                               for e in ("baseline", "speculative")]
    # the hostile token stayed text, with the console's tooltip
    evil = page.locator(".tokens[data-engine='speculative'] .tok", has_text=EVIL)
    assert evil.count() == 1 and evil.inner_text() == EVIL and evil.get_attribute("title").startswith("accepted, step")
    assert page.locator("script").count() == 2 and not dialogs
    # the final figures are the stored ones
    row = history.run(run_id)
    figures = page.inner_text("#figures")
    assert f"{row['speedup']:.2f}×" in figures
    assert f"{row['baseline_tps']:.2f} | {row['speculative_tps']:.2f}" in figures
    assert f"{row['acceptance_rate']:.2f}" in figures and f"{row['mean_accepted_length']:.2f}" in figures
    assert "identical to the baseline" in figures
    assert figures != figures_then
    # the steps by drafts accepted: live at the middle (steps up to then), whole at the end, as the console's metric
    histogram = results["speculative"].metrics.acceptance_histogram
    assert " · ".join(f"{i}: {n}" for i, n in enumerate(histogram)) in figures
    assert re.search(r"drafts accepted per step\s+0: \d+", figures_then)
    # the charts grew: a line per engine through every output token, a pair of bars per verified step
    spec_steps = sum(s.drafted > 0 for s in results["speculative"].steps)
    assert page.locator("#chart-steps rect").count() == 2 * spec_steps
    points = page.eval_on_selector_all("#chart-tokens polyline", "ls => ls.map(l => l.getAttribute('points').split(' ').length)")
    assert points == [2 + 2 * len(results[e].output_tokens) for e in ("baseline", "speculative")]
    assert time_bars(page) == {e: len(r.steps) for e, r in results.items()}
    drafting = next(s for s in results["speculative"].steps if s.drafted)
    tip = page.locator("#chart-time g[data-engine='speculative'] > g > title").nth(
        results["speculative"].steps.index(drafting)).text_content()
    # the page formats the payload's values, already rounded to 3 decimals (11.7496 -> 11.75 -> "11.8"): compare numbers
    shown = re.fullmatch(r"step (\d+): drafting ([\d.]+) ms, target pass ([\d.]+) ms, other .+", tip)
    assert shown and int(shown[1]) == drafting.step, tip
    for text, value in ((shown[2], drafting.draft_ms), (shown[3], drafting.verify_ms)):
        assert abs(float(text) - round(value, 3)) <= 0.05 + 1e-9, tip
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "replay.png"), full_page=True)

    # keys: Home restarts and plays, space pauses (time stands still), the arrows seek a twentieth of the run
    page.select_option("#speed", "0.25")
    page.evaluate("document.activeElement.blur()")
    page.keyboard.press("Home")
    page.clock.run_for(int(duration * 1000 * 2))  # half the run at 0.25x
    page.keyboard.press(" ")
    paused = time_now()
    assert page.get_attribute("body", "data-state") == "paused" and 0 < paused < duration
    page.clock.run_for(500)
    assert time_now() == paused
    page.keyboard.press("ArrowRight")
    assert time_now() == pytest.approx(paused + duration / 20, abs=2e-4)
    page.keyboard.press("ArrowLeft")
    assert time_now() == pytest.approx(paused, abs=2e-4)
    page.keyboard.press(" ")
    assert page.get_attribute("body", "data-state") == "playing"
    # with the Play button focused (just clicked), space toggles once, not also as a click on the button
    page.click("#play")
    assert page.get_attribute("body", "data-state") == "paused"
    page.keyboard.press(" ")
    assert page.get_attribute("body", "data-state") == "playing"

    assert not errors, errors
    assert not blocked, f"the replay tried to load {blocked}"
    assert requests == [url], requests
    context.close()


def test_constructed_run_in_chromium(browser, tmp_path):
    """Markup in the prompt, in tokens and in an engine's error stays text; the error shows once its engine ends."""
    history = History(tmp_path / "h.db")
    error = '<img src=x onerror="alert(3)">'
    run_id = constructed_run(history, ["a", EVIL, "</script>", "b"], error=error)
    with history.db.conn:  # as a server's steps: no timings
        history.db.execute("UPDATE steps SET draft_ms = 0, verify_ms = 0 WHERE run_id = ? AND engine = 'speculative'",
                           [run_id])
    out = write_replay(history, run_id, tmp_path / "replay.html")
    page = browser.new_context().new_page()
    requests, dialogs = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(out.as_uri())
    page.wait_for_selector("body[data-state='paused']")
    assert page.locator(".panel-error:visible").count() == 0
    page.evaluate("() => { const s = document.getElementById('scrub'); s.value = 1000; s.dispatchEvent(new Event('input')); }")
    assert page.get_attribute("body", "data-state") == "ended"
    assert page.inner_text("#prompt") == "</script><!-- prompt & <b>"
    assert page.locator(".panel-error:visible").all_inner_texts() == [error]
    assert page.locator(".tokens[data-engine='speculative'] .tok").all_text_contents() == \
        ["a", EVIL, "</script>", "b", "&nope"]
    assert page.locator("img").count() == 0 and page.locator("script").count() == 2
    # where the time went: the baseline's passes; the speculative engine's split is unknown, and nothing is guessed
    assert time_bars(page) == {"baseline": 4, "speculative": 0}
    assert "speculative: split unknown" in page.text_content("#chart-time")
    assert not dialogs and requests == [out.as_uri()]
    page.context.close()
