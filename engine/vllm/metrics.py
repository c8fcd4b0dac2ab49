"""A vLLM server's speculative-decoding counters, read from its Prometheus /metrics page.

The counters are server-wide and only grow: read before and after a run (on a server that serves nothing else),
their difference is the run's, and it gives per-position acceptance, which the per-request counts do not.
A page whose counters cannot be read (not numbers, negative, no position) or that went down makes the reading
unknown (None), with a log warning: nothing is guessed.
"""

from __future__ import annotations

import logging
import re

from engine.serving.http_safety import number

log = logging.getLogger(__name__)

SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")

# e.g. vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 12.0
COUNTER_LINE = re.compile(r'^vllm:spec_decode_(\w+?)_total\{([^}]*)\} (\S+)$')
MAX_POSITION = 1024  # draft positions: far beyond any K


def parse_metrics(text: str) -> dict | None:
    """vllm:spec_decode_* counters from a Prometheus /metrics page, summed over engines:
    {"num_drafts": float, "num_draft_tokens": float, "num_accepted_tokens": float, "per_pos": {position: float}};
    None (unknown) where one of them cannot be read."""
    out: dict = {name: 0.0 for name in SPEC_COUNTERS}
    out["per_pos"] = {}
    for line in text.splitlines():
        m = COUNTER_LINE.match(line)
        if not m or (m.group(1) not in SPEC_COUNTERS and m.group(1) != "num_accepted_tokens_per_pos"):
            continue
        name, labels = m.group(1), m.group(2)
        try:
            value = float(m.group(3))
        except ValueError:
            value = m.group(3)
        value = number(value, f"/metrics counter {name}")
        if value is None:
            return None
        if name in SPEC_COUNTERS:
            out[name] += value
            continue
        pos = re.search(r'position="(\d+)"', labels)
        if pos is None or int(pos.group(1)) > MAX_POSITION:
            log.warning("/metrics: %s without a draft position (%.80s): the counters are unknown", name, labels)
            return None
        out["per_pos"][int(pos.group(1))] = out["per_pos"].get(int(pos.group(1)), 0.0) + value
    return out


def metrics_delta(before: dict | None, after: dict | None) -> dict | None:
    """What the counters grew by between two parse_metrics readings (same shape); None where either is unknown or
    a counter went down (the server restarted, or cannot be trusted)."""
    if before is None or after is None:
        return None
    d = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    d["per_pos"] = {p: v - before["per_pos"].get(p, 0.0) for p, v in sorted(after["per_pos"].items())}
    if any(v < 0 for v in [*(d[name] for name in SPEC_COUNTERS), *d["per_pos"].values()]):
        log.warning("/metrics: the speculative counters went down during the run: unknown")
        return None
    return d
