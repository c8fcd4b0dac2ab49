"""Events in, HTML out: the token panels, the legend and the live figures. Every piece of model text is escaped."""

from __future__ import annotations

import json
import re
from html import escape

from engine.comparison import ComparisonFigures
from engine.events import RunResult, TokenEvent, TokenKind
from engine.run_metrics import RunMetrics
from specconsole.markup import number

KIND_HELP = {
    TokenKind.ACCEPTED: "accepted: a draft token the target kept",
    TokenKind.RECOVERED: "recovered: the target's own token where it rejected a draft",
    TokenKind.BONUS: "bonus: the target's extra token after all drafts were kept",
    TokenKind.BASELINE: "plain decoding: one target pass, one token",
    TokenKind.REJECTED: "rejected: draft text the target refused (not part of the answer)",
    TokenKind.PENDING: "pending: streamed by the server, classified when the request ends",
}
# a vLLM token's kind guessed while streaming (engine.vllm.steps.ChunkGuess), before the server's counts confirm it
PROVISIONAL_NOTE = "provisional: from chunk boundaries"


def _title(t: TokenEvent) -> str:
    parts = [KIND_HELP[t.kind].split(":")[0], f"step {number(t.step)}", f"position {number(t.position)}",
             f"token id {number(t.token_id)}"]
    if t.provisional:
        parts.insert(1, PROVISIONAL_NOTE)
    if t.p is not None:
        parts.append(f"p(target) = {number(t.p, '.3f')}")
    if t.q is not None:
        parts.append(f"q(draft) = {number(t.q, '.3f')}")
    return ", ".join(parts)


# Embedding, override and isolate controls (U+202A-U+202E, U+2066-U+2069) in model text would re-order every token
# after them in the panel; such a token is isolated, so that they act on its own text only.
BIDI_CONTROLS = re.compile("[\u202a-\u202e\u2066-\u2069]")


def token_span(t: TokenEvent) -> str:
    text = escape(t.text, quote=True) or "&#8203;"
    tag = "del" if t.kind == TokenKind.REJECTED else "span"
    isolate = ' style="unicode-bidi:isolate"' if BIDI_CONTROLS.search(t.text) else ""
    classes = f"tok {t.kind.value}" + (" provisional" if t.provisional else "")
    return f'<{tag} class="{classes}" title="{escape(_title(t), quote=True)}"{isolate}>{text}</{tag}>'


def tokens_html(tokens: list[TokenEvent], show_rejected: bool = True, error: str | None = None,
                status: str = "") -> str:
    spans = [token_span(t) for t in tokens if show_rejected or t.kind != TokenKind.REJECTED]
    body = "".join(spans) or '<span class="placeholder">waiting for tokens…</span>'
    extra = f'<div class="panel-error">{escape(error)}</div>' if error else ""
    footer = f'<div class="panel-status">{escape(status)}</div>' if status else ""
    return f'<div class="tokens">{body}</div>{extra}{footer}'


class PanelFeed:
    """What one live token panel shows, so that each update sends only the tokens that are new to it.

    The page (assets/live_panel.js) appends the new spans to the ones it has; it re-renders the panel only when
    tokens it already shows changed kind or stopped being provisional (a vLLM re-classification at the end of a
    request) or when it missed a message, which the last message (`final`) repairs from the full HTML it carries."""

    def __init__(self, run: str, show_rejected: bool = True):
        self.run, self.show_rejected = run, show_rejected
        self.kinds: list[tuple[TokenKind, bool]] = []  # (kind, provisional) of every token sent so far, in order
        self.footer: tuple = ()

    def message(self, tokens: list[TokenEvent], status: str = "", error: str | None = None,
                final: bool = False) -> str | None:
        """The JSON message for the page, or None when the panel would not change."""
        visible = [t for t in tokens if self.show_rejected or t.kind != TokenKind.REJECTED]
        reset = any((t.kind, t.provisional) != shown for t, shown in zip(visible, self.kinds))
        start = 0 if reset else len(self.kinds)
        new = visible[start:]
        if not (new or reset or final) and (status, error) == self.footer:
            return None
        self.kinds, self.footer = [(t.kind, t.provisional) for t in visible], (status, error)
        message = {"run": self.run, "start": start, "tokens": [token_span(t) for t in new], "total": len(visible),
                   "status": status, "error": error, "reset": reset}
        if final:
            message["final_html"] = "".join(token_span(t) for t in visible)
        return json.dumps(message)


def panel_notice(run: str, error: str) -> str:
    """A live panel's message that shows only an error (nothing ran)."""
    return PanelFeed(run).message([], error=error, final=True)


def legend_html() -> str:
    items = [TokenKind.ACCEPTED, TokenKind.RECOVERED, TokenKind.BONUS, TokenKind.REJECTED, TokenKind.BASELINE]
    cells = "".join(
        f'<span class="legend-item"><span class="tok {k.value}">{escape(k.value)}</span> {escape(KIND_HELP[k].split(": ")[1])}</span>'
        for k in items
    )
    return f'<div class="legend">{cells}</div>'


# The three figures the presenter view keeps (console.css): what a room can read from the back.
HEADLINE = ("speedup", "acceptance (all | last 8 steps)", "tokens/s (baseline | speculative)")


def _bound_unknown(speculative: RunResult | None, comparison: ComparisonFigures) -> bool:
    """A finished run without the bound: its inputs (draft and verify costs, steps with drafts) were not measured."""
    return bool(speculative and speculative.finish_reason) and comparison.theoretical_bound is None


def _sampling_check_rows(check: dict) -> list[tuple[str, str]]:
    """The sampling check of a sampled run (engine.analysis.check) and the likelihoods it rests on."""
    if not check.get("sampling_check") and not check.get("sampling_check_reason"):
        return []  # greedy (checked token for token), or not finished yet
    status = check["sampling_check"]
    label = {"ok": '<span class="exact ok">✔ ok</span>', "suspect": '<span class="exact diverged">✖ suspect</span>'}
    note = f'<div class="fig-note">{escape(check.get("sampling_check_reason") or "")}</div>'
    rows = [("sampling check", label.get(status, "not checked") + note)]
    if check.get("nll_baseline") is not None:
        rows.append(("NLL nats/token (baseline | speculative)",
                     f'{number(check["nll_baseline"], ".2f")} | {number(check.get("nll_speculative"), ".2f")}'
                     f'<div class="fig-note">perplexity {number(check.get("perplexity_baseline"), ".1f")} | '
                     f'{number(check.get("perplexity_speculative"), ".1f")}</div>'))
    return rows


def _provisional_figure(s: RunMetrics) -> str:
    """How often the kinds guessed while streaming were the final ones (engine.vllm.steps.provisional_accuracy)."""
    if s.provisional_accuracy is None:
        return "unknown"
    note = f'<div class="fig-note">of {number(s.output_tokens)} tokens, guessed from chunk boundaries</div>'
    return f'{number(s.provisional_accuracy, ".0%")}{note}'


def _server_counters_figure(s: RunMetrics) -> str:
    """The server's own count of the run (its /metrics counters, engine.serving.counters): a disagreement with the
    run's count flagged, a difference with a known cause said."""
    c = s.server_counters
    if c is None:
        return "unknown"
    value = f'{number(c.draft_tokens, ".0f")} | {number(c.accepted_tokens, ".0f")}'
    if c.mismatch:
        return value + f' <span class="exact diverged">✖ {escape(str(c.mismatch))}</span>'
    if c.expected_difference:
        return value + f'<div class="fig-note">{escape(str(c.expected_difference))}</div>'
    return value


def _get(m: RunMetrics | None, key: str):
    """A figure of a run's metrics; None before the run has any."""
    return getattr(m, key) if m is not None else None


def _known(m: RunMetrics | None, key: str, spec: str = "") -> str:
    """A figure, "unknown" where the backend cannot know it (None in the run's metrics), "–" before there is a run."""
    return "unknown" if m is not None and getattr(m, key) is None else number(_get(m, key), spec)


def _histogram_figure(s: RunMetrics | None) -> str:
    """How many speculative steps accepted 0, 1, 2, ... drafts, and the share that accepted none."""
    counts = _get(s, "acceptance_histogram")
    if not counts:  # None: not known, or no run yet; []: no step yet
        return _known(s, "acceptance_histogram") if counts is None else "–"
    bars = " · ".join(f"{i}: {number(n)}" for i, n in enumerate(counts))
    return (f'{bars}<div class="fig-note">{number(s.steps_accepting_nothing, ".0%")} of the steps accepted '
            f'nothing: each bought one token for a target pass and a draft</div>')


def _time_split_figure(b: RunMetrics | None, s: RunMetrics | None) -> str:
    """Where each engine's time went (engine.metrics.time_split), in seconds."""
    def split(m: RunMetrics | None) -> str:
        parts = [_get(m, k) for k in ("drafting_ms", "verifying_ms", "other_ms")]
        if m is not None and parts[0] is None:
            return "unknown"
        return " | ".join(number(p / 1000 if isinstance(p, (int, float)) else p, ".2f") for p in parts)

    return f'{split(s)}<div class="fig-note">baseline: {split(b)}</div>'


def near_tie_text(comparison: dict) -> str:
    """Plain text: at a greedy run's first divergence, each engine's pass there, its token, its runner-up and the
    logit margin between them (engine.metrics.near_tie); "unknown" where an engine did not record it (a run saved
    before it was recorded included); "" for a run without a divergence. The replay shows it too."""
    if comparison.get("identical") is not False or "near_tie" not in comparison:
        return ""
    tie = comparison["near_tie"]
    sides = [tie.get(e) for e in ("baseline", "speculative")] if isinstance(tie, dict) else []
    if len(sides) != 2 or not all(isinstance(t, dict) for t in sides):
        return "why: unknown (an engine recorded no runner-up there)"

    def token(text, token_id) -> str:  # a hand-edited file may hold anything: only a str or an int is shown
        return repr(text) if isinstance(text, str) else f"token {token_id}" if isinstance(token_id, int) else "?"

    def margin(m) -> str:
        return f"{m:.3g}" if isinstance(m, float) else "?"

    parts = [f"{name} pass chose {token(t.get('text'), t.get('token'))} over "
             f"{token(t.get('runner_up_text'), t.get('runner_up'))} by {margin(t.get('margin'))}"
             for name, t in zip(("the plain", "the speculative engine's"), sides)]
    return f"near-tie? {'; '.join(parts)} (logits; the probability margin is at most the logit margin)"


def figures_html(baseline: RunResult | None, speculative: RunResult | None, comparison: ComparisonFigures,
                 mode: str, rolling_acceptance: float | None, checks: dict | None = None) -> str:
    """The figures of a pair; `checks`: the machine's load and the sampling check, once the run ended
    (specconsole.runner.Comparison.checks; a saved run's comparison column holds them beside the figures)."""
    b = baseline.metrics if baseline else None
    s = speculative.metrics if speculative else None
    checks = checks or {}
    exact = ""
    if comparison.identical is not None:
        if comparison.identical:
            exact = '<span class="exact ok">✔ identical to the baseline</span>'
        elif comparison.first_divergence is not None:
            exact = (f'<span class="exact diverged">✖ first divergence at token '
                     f'{number(comparison.first_divergence)}</span>')
            why = near_tie_text(comparison.to_dict())
            if why:
                exact += f' <span class="why near-tie">{escape(why)}</span>'
            if _get(s, "divergence_note"):  # why this backend's greedy outputs can differ (llama.cpp)
                exact += f' <span class="why">{escape(str(s.divergence_note))}</span>'
    rows = [
        ("tokens/s (baseline | speculative)",
         f'{number(_get(b, "tokens_per_s"), ".2f")} | {number(_get(s, "tokens_per_s"), ".2f")}'),
        ("speedup", number(comparison.speedup, ".2f", "×")),
        *_sampling_check_rows(checks),
        ("acceptance (all | last 8 steps)",
         f'{number(_get(s, "acceptance_rate"), ".2f")} | {number(rolling_acceptance, ".2f")}'),
        ("mean accepted length", number(_get(s, "mean_accepted_length"), ".2f")),
        ("steps won by a token-tree alternative", number(_get(s, "tree_accepted"))),
        ("TTFT ms (baseline | speculative)",
         f'{number(_get(b, "ttft_ms"), ".0f")} | {number(_get(s, "ttft_ms"), ".0f")}'),
        ("TPOT ms (baseline | speculative)",
         f'{number(_get(b, "tpot_ms"), ".1f")} | {number(_get(s, "tpot_ms"), ".1f")}'),
        ("target passes saved", "unknown" if s is not None and s.passes_saved is None
                                else f'{number(_get(s, "passes_saved"))} of {number(_get(s, "output_tokens"))}'),
        ("bound: ideal | this machine", "unknown" if _bound_unknown(speculative, comparison)
                                        else f'{number(comparison.theoretical_bound, ".2f", "×")} | '
                                             f'{number(comparison.machine_bound, ".2f", "×")}'),
        ("efficiency (speedup / machine bound)", number(comparison.efficiency, ".2f")),
        ("fallbacks", number(_get(s, "fallback_count"))),
        ("drafts accepted per step", _histogram_figure(s)),
        ("ignored drafts (cut off by a stop)", _known(s, "ignored_drafts")),
        ("time: drafting | target passes | other (s)", _time_split_figure(b, s)),
    ]
    # only a server run (it has the server's own figures, or its counters) has counters to show, or to say are
    # unknown (a server started without them); our own engine has none, and a row that always says so is noise
    if s is not None and (s.server_counters is not None or s.server):
        rows.append(("server's own counters: drafted | accepted", _server_counters_figure(s)))
    if s is not None and "time_to_first_token_ms" in s.server:  # what the vLLM servers measured themselves
        def server(m: RunMetrics | None, key: str, spec: str) -> str:
            return number(m.server.get(key) if m is not None else None, spec)

        rows += [
            ("vLLM TTFT ms (baseline | speculative)",
             f'{server(b, "time_to_first_token_ms", ".0f")} | {server(s, "time_to_first_token_ms", ".0f")}'),
            ("vLLM ITL ms (baseline | speculative)",
             f'{server(b, "mean_itl_ms", ".1f")} | {server(s, "mean_itl_ms", ".1f")}'),
            ("vLLM tokens/s (baseline | speculative)",
             f'{server(b, "tokens_per_second", ".1f")} | {server(s, "tokens_per_second", ".1f")}'),
            ("highlighting", escape(str(s.highlighting or "–"))),
            ("provisional kinds right", _provisional_figure(s)),
        ]
    rows.append(("mode", escape(mode)))
    if "noisy" in checks:  # known once the run ended
        detail = (escape(str(checks.get("noise"))) if checks["noisy"]
                  else f"others used {number(checks.get('other_cores'), '.2f')} cores, the console's page "
                       f"{number(checks.get('page_cores'), '.2f')}")
        if checks.get("others_in_passes"):  # fair mode: where the disturbance fell
            detail += "; others during each engine's passes: " + ", ".join(
                f"{escape(e)} {number(v, '.2f')}" for e, v in checks["others_in_passes"].items())
        if checks.get("waited_s"):  # fair mode: the page's cost, outside the timed passes
            detail += (f"; between passes the engines waited {number(checks['waited_s'], '.2f')} s for the page "
                       "(not in their timings)")
        rows.append(("machine during the run", f'{"noisy" if checks["noisy"] else "quiet"}'
                                               f'<div class="fig-note">{detail}</div>'))
    cells = "".join(f'<div class="fig{" headline" if k in HEADLINE else ""}"><div class="fig-label">{escape(k)}</div>'
                    f'<div class="fig-value">{v}</div></div>' for k, v in rows)
    return f'<div class="figures">{cells}</div><div class="exactness">{exact}</div>'


def engines_html(results: dict[str, RunResult], labels: dict[str, str], comparisons: dict[str, ComparisonFigures],
                 mode: str) -> str:
    """An N-way run's figures, one row per engine (the baseline first): tokens/s, speedup, acceptance, mean accepted
    length, TTFT and whether its greedy output is identical to the baseline's."""
    rows = []
    for engine, r in results.items():
        m, c = r.metrics, comparisons.get(engine, ComparisonFigures())
        if c.identical:
            same = '<span class="exact ok">✔ identical</span>'
        elif c.identical is not None and c.first_divergence is not None:
            same = f'<span class="exact diverged">✖ diverges at token {number(c.first_divergence)}</span>'
        else:
            same = "–"
        cells = [escape(engine), escape(labels.get(engine, engine)), number(m.tokens_per_s, ".2f"),
                 "–" if engine == "baseline" else number(c.speedup, ".2f", "×"),
                 number(m.acceptance_rate, ".2f"), number(m.mean_accepted_length, ".2f"),
                 number(m.ttft_ms, ".0f"), same]
        rows.append(f'<tr data-engine="{escape(engine, quote=True)}">' + "".join(f"<td>{c}</td>" for c in cells)
                    + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("engine", "configuration", "tokens/s", "speedup", "acceptance",
                                            "mean accepted length", "TTFT ms", "greedy output"))
    note = ("all engines ran at once, sharing the machine: each is slower than it would be alone" if mode == "race"
            else "fair mode: the engines took turns, one target pass each; each was timed alone")
    return (f'<table class="engines-table"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
            f'<div class="fig-note">{escape(note)}</div>')
