"""A saved run as one self-contained HTML file that replays the comparison at its recorded timing, offline.

The file holds the run's data as JSON (`payload`), the console's CSS and legend, and assets/replay.js, which plays
the tokens back by their recorded times with play/pause, speed, scrub and restart. Nothing in it loads anything:
scripts and styles are inline, the charts are SVG drawn by replay.js, and a Content-Security-Policy forbids every
fetch (and every script but ours, by hash), so the file works from a USB stick in a lecture hall.

Model text is data, never markup: it travels inside <script type="application/json"> with '<', '>' and '&' written
as \\u003c etc. (so no token can close that element), and replay.js inserts it with textContent.

The payload is a list of engines (the baseline first, then one or more speculative ones), so that a comparison of
several speculative methods replays with the same file format.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
from html import escape
from pathlib import Path

from engine.comparison import ComparisonFigures
from engine.events import RunResult
from specconsole.history import History
from specconsole.render import BIDI_CONTROLS, _title, legend_html, near_tie_text

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
PAYLOAD_VERSION = 1
# Token columns in the payload (in _engine's order): one short array per token keeps a 2,000-token run small.
TOKEN_FIELDS = ("kind", "text", "t", "step", "position", "title", "isolate")


class UnknownRun(LookupError):
    """No run with this id in the history."""


def _json_for_script(value) -> str:
    """JSON that is safe inside a <script> element: no '<', '>' or '&' at all, so that no text (`</script>`,
    `<!--`) can end or alter the element. ensure_ascii also writes lone surrogates and U+2028 as escapes."""
    text = json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _engine(result: RunResult, final: dict) -> dict:
    """One engine's part of the payload: its tokens and steps in time order, and its final figures."""
    tokens, t_max = [], 0.0
    for t in result.tokens:
        t_max = max(t_max, t.time_s or 0.0)  # the player searches by time: keep it non-decreasing
        tokens.append([t.kind.value, t.text, round(t_max, 6), t.step, t.position, _title(t),
                       1 if BIDI_CONTROLS.search(t.text) else 0])
    steps = [[s.step, s.drafted, s.accepted, round(s.time_s, 6), round(s.draft_ms, 3), round(s.verify_ms, 3)]
             for s in result.steps]
    n, tps = result.metrics.output_tokens, result.metrics.tokens_per_s
    last = max([t_max] + [s[3] for s in steps])
    # when the engine finished: the run's total time (n / tokens per second), at least its last event
    end = max(last, n / tps) if n and tps else last
    return {"name": result.engine, "method": result.method, "error": result.error, "end": round(end, 6),
            "tokens": tokens, "steps": steps, "final": final}


def payload(history: History, run_id: str) -> dict:
    """Everything the replay shows, from the history. Raises UnknownRun.

    {version, run: {id, prompt, status, method, mode, ...}, token_fields, duration (s), identical, first_divergence,
     engines: [{name, method, error, end (s), tokens: [[kind, text, t, step, position, title, isolate], ...],
                steps: [[step, drafted, accepted, t, draft_ms, verify_ms], ...],
                final: {tokens_per_s, acceptance_rate, mean_accepted_length, speedup}}, ...]}
    The baseline comes first; `final` holds the stored figures, shown once the replay reaches the engine's end."""
    row = history.run(run_id)
    if row is None:
        raise UnknownRun(f"no run {run_id!r} in the history {history.path}")
    results = history.results(run_id)  # every engine, the baseline first
    comparison = json.loads(row.get("comparison") or "{}")
    figures = ComparisonFigures.from_dict(comparison)
    saved = history.engines(run_id)  # labels and per-engine comparisons of an N-way run (none for older runs)
    baseline = results.get("baseline")
    base_tps = baseline.metrics.tokens_per_s if baseline else None
    engines = []
    for name, r in results.items():
        tps = r.metrics.tokens_per_s
        final = {"tokens_per_s": tps, "acceptance_rate": r.metrics.acceptance_rate,
                 "mean_accepted_length": r.metrics.mean_accepted_length,
                 "speedup": None if name == "baseline" else (tps / base_tps if tps and base_tps else None)}
        shown = figures if name == "speculative" else ComparisonFigures.from_dict(
            saved.get(name, {}).get("comparison"))
        if name != "baseline" and shown.speedup is not None:
            final["speedup"] = shown.speedup  # the figure the console showed for this run
        final = {k: v if v is None or math.isfinite(v) else None for k, v in final.items()}  # JSON has no NaN
        engines.append(_engine(r, final) | {"label": saved.get(name, {}).get("label") or name})
    run = {k: row.get(k) for k in ("id", "created_at", "status", "error", "category", "prompt", "backend",
                                   "target_model", "draft_model", "method", "mode")}
    return {
        "version": PAYLOAD_VERSION,
        "run": run,
        "token_fields": list(TOKEN_FIELDS),
        "engines": engines,
        "duration": max([e["end"] for e in engines], default=0.0),
        "identical": figures.identical,
        "first_divergence": figures.first_divergence,
        "near_tie": near_tie_text(comparison),  # why it parted, as the console said it
    }


def replay_html(history: History, run_id: str) -> str:
    """The self-contained replay page of one saved run. Raises UnknownRun."""
    data = payload(history, run_id)
    script = (ASSETS / "replay.js").read_text()
    if "</script" in script.lower() or "<!--" in script:  # it is inlined as is: either would upset the parser
        raise ValueError("assets/replay.js must not contain '</script' or '<!--'")
    css = (ASSETS / "console.css").read_text() + (ASSETS / "replay.css").read_text()
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    # default-src 'none': no request of any kind; the one script that runs is ours (by hash); the JSON is not run
    csp = f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; img-src data:"
    title = escape(f"SpecConsole replay {run_id}")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style>
</head>
<body data-state="loading">
<header>
  <h1>SpecConsole replay</h1>
  <div id="run-info" class="status-line"></div>
  <blockquote id="prompt"></blockquote>
</header>
<div class="controls" role="toolbar" aria-label="replay controls">
  <button id="play" type="button" title="play / pause (space)">Play</button>
  <button id="restart" type="button" title="restart (Home)">Restart</button>
  <label>speed <select id="speed">
    <option value="0.25">0.25×</option><option value="0.5">0.5×</option><option value="1" selected>1×</option>
    <option value="2">2×</option><option value="4">4×</option></select></label>
  <input id="scrub" type="range" min="0" max="1000" step="1" value="0" aria-label="time in the run (← / → seek)">
  <span id="clock" class="clock"></span>
  <label><input id="show-rejected" type="checkbox" checked> show rejected drafts</label>
</div>
{legend_html()}
<div id="panels" class="panels"></div>
<div id="figures"></div>
<div class="charts">
  <figure><figcaption>Tokens over time</figcaption><svg id="chart-tokens" viewBox="0 0 480 240"></svg></figure>
  <figure><figcaption>Drafted and accepted per step</figcaption><svg id="chart-steps" viewBox="0 0 480 240"></svg>
  </figure>
  <figure><figcaption>Where the time went, per target pass</figcaption>
    <svg id="chart-time" viewBox="0 0 480 240"></svg></figure>
</div>
<p class="fig-note">Replayed from the recorded token times. Keys: space play/pause, ← → seek, Home restart.</p>
<script id="replay-data" type="application/json">{_json_for_script(data)}</script>
<script>{script}</script>
</body>
</html>
"""


def write_replay(history: History, run_id: str, path: str | Path) -> Path:
    """Write the replay of one run to `path` (UTF-8). Raises UnknownRun."""
    path = Path(path)
    html = replay_html(history, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html, encoding="utf-8")
    log.info("replay of run %s written to %s (%d kB)", run_id, path, len(html) // 1024)
    return path
