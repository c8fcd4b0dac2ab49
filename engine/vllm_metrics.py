"""A vLLM server's speculative-decoding counters, read from its Prometheus /metrics page.

The counters are server-wide and only grow: read before and after a run (on a server that serves nothing else),
their difference is the run's, and it gives per-position acceptance, which the per-request counts do not.
"""

from __future__ import annotations

import re

SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")

# e.g. vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 12.0
COUNTER_LINE = re.compile(r'^vllm:spec_decode_(\w+?)_total\{([^}]*)\} ([0-9.eE+-]+)$')


def parse_metrics(text: str) -> dict:
    """vllm:spec_decode_* counters from a Prometheus /metrics page, summed over engines:
    {"num_drafts": float, "num_draft_tokens": float, "num_accepted_tokens": float, "per_pos": {position: float}}."""
    out: dict = {name: 0.0 for name in SPEC_COUNTERS}
    out["per_pos"] = {}
    for line in text.splitlines():
        m = COUNTER_LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2), float(m.group(3))
        if name in SPEC_COUNTERS:
            out[name] += value
        elif name == "num_accepted_tokens_per_pos":
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + value
    return out


def metrics_delta(before: dict, after: dict) -> dict:
    """What the counters grew by between two parse_metrics readings (same shape)."""
    d = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    d["per_pos"] = {p: v - before["per_pos"].get(p, 0.0) for p, v in sorted(after["per_pos"].items())}
    return d
