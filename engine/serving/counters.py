"""A server's speculative-decoding counters, read from its Prometheus /metrics page (vLLM's vllm:spec_decode_*,
llama-server's llamacpp:spec_decode_*, started with --metrics), and the server's count of a run beside the run's own.

The counters are server-wide and only grow: read before and after a run, their difference is the run's where the
server served nothing else meanwhile, and it gives per-position acceptance, which the per-request counts do not.
A page whose counters cannot be read (missing, not numbers, negative, no position) or that went down makes the
reading unknown (None), with a log warning: nothing is guessed.

When the counters grow: vLLM adds each engine step's counts as it logs the step; llama-server (b11434) adds a
request's counts all at once, when it releases the request's slot, right after sending the final chunk (measured: a
reading mid-run shows none of the run, one right after the stream all of it), or, for a request the client dropped,
only once it notices the drop (a reading right after a cancel shows none of it).
"""

from __future__ import annotations

import logging
import math
import re

from engine.run_metrics import ServerCounters
from engine.serving.http_safety import number

log = logging.getLogger(__name__)

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POSITION = "num_accepted_tokens_per_pos"
MAX_POSITION = 1024  # draft positions: far beyond any K


def parse_counters(text: str, prefix: str) -> dict | None:
    """The `prefix`* counters ("vllm:spec_decode_", "llamacpp:spec_decode_") of a Prometheus /metrics page, summed
    over label sets (vLLM's engines): {"num_drafts", "num_draft_tokens", "num_accepted_tokens": float,
    "per_pos": {position: float}, "rounding": float}. `rounding` is how far a printed counter may be from the true
    one: llama-server prints its counters as C++ doubles, to 6 significant digits (1234567 as 1.23457e+06), so past
    a million they are rounded. None (unknown) where a counter is missing or cannot be read."""
    line_re = re.compile(rf'^{re.escape(prefix)}(\w+?)_total(?:\{{([^}}]*)\}})? (\S+)$')
    out: dict = {name: 0.0 for name in COUNTERS}
    out["per_pos"], out["rounding"] = {}, 0.0
    seen = set()
    for line in text.splitlines():
        m = line_re.match(line)
        if not m or m.group(1) not in (*COUNTERS, PER_POSITION):
            continue
        name, labels, printed = m.group(1), m.group(2) or "", m.group(3)
        try:
            value = float(printed)
        except ValueError:
            value = printed
        value = number(value, f"/metrics counter {prefix}{name}")
        if value is None:
            return None
        out["rounding"] = max(out["rounding"], _rounding(printed, value))
        seen.add(name)
        if name in COUNTERS:
            out[name] += value
            continue
        pos = re.search(r'position="(\d+)"', labels)
        if pos is None or int(pos.group(1)) > MAX_POSITION:
            log.warning("/metrics: %s without a draft position (%.80s): the counters are unknown", name, labels)
            return None
        out["per_pos"][int(pos.group(1))] = out["per_pos"].get(int(pos.group(1)), 0.0) + value
    missing = [name for name in COUNTERS if name not in seen]
    if missing:
        log.warning("/metrics has no %s: the counters are unknown", ", ".join(f"{prefix}{n}_total" for n in missing))
        return None
    return out


def _rounding(printed: str, value: float) -> float:
    """How far a printed counter may be from the true one: half a unit of its 6th significant digit where it is
    printed with an exponent (C++'s default, as %g: 1.23457e+06, 1e+06), else 0 (printed whole: exact)."""
    if "e" not in printed.lower() or value < 1:
        return 0.0
    return 10.0 ** (math.floor(math.log10(value)) - 5) / 2


def counters_delta(before: dict | None, after: dict | None) -> dict | None:
    """What the counters grew by between two parse_counters readings (same shape, `rounding` the two readings'
    together); None where either is unknown or a counter went down (the server restarted, or cannot be trusted)."""
    if before is None or after is None:
        return None
    d = {name: after[name] - before[name] for name in COUNTERS}
    d["per_pos"] = {p: v - before["per_pos"].get(p, 0.0) for p, v in sorted(after["per_pos"].items())}
    d["rounding"] = before["rounding"] + after["rounding"]
    if any(v < 0 for v in [*(d[name] for name in COUNTERS), *d["per_pos"].values()]):
        log.warning("/metrics: the speculative counters went down during the run: unknown")
        return None
    return d


def server_counters(before: dict | None, after: dict | None, drafted: int | None, accepted: int | None,
                    cut: int = 0, shared: bool = False, stopped: bool = False) -> ServerCounters | None:
    """The server's count of a run (its counters' growth between the readings `before` and `after`) beside the run's
    own `drafted` / `accepted` (None: not known, nothing to compare). A difference is a real disagreement
    (`mismatch`, flagged) unless one of these explains it (`expected_difference`, said but not flagged):
    - `cut`: accepted drafts the run does not show because a stop (EOS, stop string, token limit) ended the output
      inside their step; the server counts every draft its target pass accepted, so it counts `cut` more;
    - `shared`: the server may have served other requests meanwhile (one the console attached to): its counters are
      server-wide, so it counting more drafts than the run, and of them at most as many more accepted, is no
      disagreement; counting fewer is;
    - `stopped`: the run was cancelled: the server goes on for steps the console never read, and llama-server counts
      a request only when it notices it was dropped, which may be after the second reading;
    - the server's rounding of large counters (parse_counters).
    None where either reading is unknown."""
    delta = counters_delta(before, after)
    if delta is None:
        return None
    drafts = delta["num_drafts"]
    counters = ServerCounters(drafts, delta["num_draft_tokens"], delta["num_accepted_tokens"],
                              [v / drafts for _, v in sorted(delta["per_pos"].items())] if drafts else [])
    if drafted is None or accepted is None:
        return counters
    tolerance = delta["rounding"]
    more_drafted, more_accepted = counters.draft_tokens - drafted, counters.accepted_tokens - accepted
    counts = _counts(counters, drafted, accepted)
    if abs(more_drafted) <= tolerance and abs(more_accepted - cut) <= tolerance:
        if more_drafted or more_accepted - cut:
            counters.expected_difference = f"{counts}: within the server's rounding of counters this large"
        elif cut:
            counters.expected_difference = (f"{counts}: a stop ended the output inside the last step, and the "
                                            f"server also counts the {cut} {'draft' if cut == 1 else 'drafts'} it "
                                            "accepted past the stop")
    elif stopped:
        counters.expected_difference = (f"{counts}: the run was stopped, so the server's count may lack its last "
                                        "steps or hold steps the console never read")
    elif shared and more_drafted > tolerance and -tolerance <= more_accepted - cut <= more_drafted + tolerance:
        counters.expected_difference = (f"{counts}: the server's counters are server-wide, and this attached server "
                                        "may have served other requests meanwhile")
    else:
        counters.mismatch = counts
    return counters


def _counts(counters: ServerCounters, drafted: int, accepted: int) -> str:
    """"the server counted 40 drafted and 31 accepted tokens, this run 36 and 30"."""
    return (f"the server counted {counters.draft_tokens:.0f} drafted and {counters.accepted_tokens:.0f} accepted "
            f"tokens, this run {drafted} and {accepted}")
