"""`launch.py demo` in the terminal: each engine's answer streamed as it comes, coloured by token kind on a terminal
(the answer alone when the output is a file or a pipe), then the figures and checks of a pair, or one table of an
N-way comparison."""

from __future__ import annotations

import sys
from dataclasses import replace

from engine.backend import extra_engine
from engine.analysis.check import sampling_check
from engine.comparison import ComparisonFigures
from engine.events import Reclassified, RunResult, TokenEvent
from engine.metrics import compare
from engine.run_metrics import RunMetrics

# ANSI colours of the token kinds (the console uses the same kinds, colour-blind-safe, in CSS)
COLOURS = {"accepted": "\033[34m", "recovered": "\033[33m", "bonus": "\033[35m", "rejected": "\033[9;90m"}
RESET = "\033[0m"


def pair(backend, req) -> int:
    """The baseline, then the speculative engine, streamed; then the figures and the checks (greedy: identical or the
    first divergence; sampled: the sampling check)."""
    backend.validate(req)  # before printing anything
    results = {engine: stream(backend, engine, req) for engine in ("baseline", "speculative")}
    c = compare(results["baseline"], results["speculative"], req.sampling.greedy)
    check = sampling_check(backend, req, results)  # after both runs, outside their timing
    sys.stdout.write("\n".join(demo_lines(results["speculative"].metrics, c, check)) + "\n")
    return 0


def table(backend, base, variants: list) -> int:
    """The baseline, then each speculative variant (specconsole.variants.choose, the main one first), one after the
    other, streamed; then one table: engine, label, tokens/s, speedup, acceptance, identical."""
    engines = {"speculative": variants[0], **{extra_engine(i): v for i, v in enumerate(variants[1:])}}
    for v in variants:  # every configuration can be served before anything is printed (a missing draft model)
        backend.validate(v.request)
    results = {"baseline": stream(backend, "baseline", base)}
    for engine, v in engines.items():
        results[engine] = stream(backend, engine, v.request, v.label, v.server)
    greedy = base.sampling.greedy
    rows = [("engine", "label", "tokens/s", "speedup", "acceptance", "identical")]
    for engine, r in results.items():
        c = compare(results["baseline"], r, greedy) if engine != "baseline" else ComparisonFigures()
        acceptance = r.metrics.acceptance_rate
        identical = "-" if c.identical is None else ("yes" if c.identical else f"no@{c.first_divergence}")
        speedup = "-" if not c.speedup else f"{c.speedup:.2f}x"
        rows.append((engine, engines[engine].label if engine in engines else "baseline",
                     f"{r.metrics.tokens_per_s or 0:.2f}", speedup,
                     "-" if acceptance is None else f"{acceptance:.2f}", identical))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    sys.stdout.write("\n" + "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                                       for row in rows) + "\n")
    return 0


def stream(backend, engine: str, req, label: str | None = None, server: str | None = None):
    """One engine's run, written to stdout as it comes; its RunResult."""
    out, result, tokens = sys.stdout, None, []
    out.write(f"\n== {engine}{f' ({label})' if label else ''} ==\n")
    if engine == "baseline":
        events = backend.baseline(req)
    else:  # `server`: which of the backend's own speculative engines (vLLM: an extra server)
        events = backend.speculative(req, engine=server) if server else backend.speculative(req)
    for event in events:
        if isinstance(event, TokenEvent):
            tokens.append(replace(event))
            if not out.isatty():
                if event.kind.value != "rejected":  # plain text output: the answer only
                    out.write(event.text)
                continue
            out.write(coloured(event))
            out.flush()
        elif isinstance(event, Reclassified) and out.isatty():
            # the kinds came at the end of the request (vLLM): the answer once more, coloured by its final kinds
            event.apply(tokens)
            out.write("\n-- the same tokens, by kind --\n" + "".join(coloured(t) for t in tokens))
        elif isinstance(event, RunResult):
            result = event
    m = result.metrics
    passes = "unknown" if m.target_passes is None else m.target_passes
    out.write(f"\n[{result.finish_reason}{': ' + result.error if result.error else ''}] {m.output_tokens} tokens, "
              f"{m.tokens_per_s or 0:.2f} tok/s, target passes {passes}\n")
    return result


def coloured(token) -> str:
    colour = COLOURS.get(token.kind.value, "")
    return f"{colour}{token.text}{RESET if colour else ''}"


def demo_lines(s: RunMetrics, c: ComparisonFigures, check: dict) -> list[str]:
    """The pair's figures and checks, one line each: `s` the speculative run's metrics, `c` the comparison, `check`
    the sampling check (engine.analysis.check)."""
    lines = [f"speedup {c.speedup or 0:.2f}x (decode {c.decode_speedup or 0:.2f}x)"]
    if s.acceptance_rate is not None:
        lines.append(f"acceptance {s.acceptance_rate:.2f}, mean accepted length {s.mean_accepted_length:.2f}")
    if s.highlighting:
        lines.append(f"highlighting: {s.highlighting}")
    if c.machine_bound is not None:
        lines.append(f"bound on this machine {c.machine_bound:.2f}x, efficiency {c.efficiency or 0:.2f}")
    else:
        lines.append("bound: unknown (draft and verify costs not measured)")
    if c.identical is not None:
        lines.append("greedy outputs identical" if c.identical
                     else f"outputs diverge at token {c.first_divergence}"
                     + (f" ({s.divergence_note})" if s.divergence_note else ""))
    if check.get("nll_baseline") is not None:
        lines.append(f"NLL nats/token: baseline {check['nll_baseline']:.2f}, speculative "
                     f"{check['nll_speculative']:.2f} (perplexity {check['perplexity_baseline']:.1f} | "
                     f"{check['perplexity_speculative']:.1f})")
    if check.get("sampling_check") or check.get("sampling_check_reason"):
        lines.append(f"sampling check: {check.get('sampling_check') or 'not checked'} "
                     f"({check.get('sampling_check_reason')})")
    return lines
