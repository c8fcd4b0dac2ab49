"""Calibrates the sampling check (engine.analysis.check) on the local engine, whose sampler is tested to be lossless.

    python -m benchmarks.calibrate_check --prompts 4 --out /tmp/calibration.json     # what engine/analysis/check.py quotes
    python -m benchmarks.calibrate_check --categories chat --out /tmp/more.json        # some categories only
    python -m benchmarks.calibrate_check --load /tmp/calibration.json /tmp/more.json   # the table from saved scores

Every suite prompt runs on the baseline and the speculative engine (n-gram drafts, K=4) at each temperature, length
and seed; both outputs are scored under the target (LocalBackend.score). Per temperature it prints the distribution
of the NLL difference over these lossless pairs (nats/token, over the shorter length, as the check compares them),
of z (that difference in standard errors of the baseline's tokens), the tokens below e^-20, and how many pairs the
check would call suspect. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from itertools import product
from pathlib import Path

from engine.exact.backend import LocalBackend
from engine.drafting import Drafting
from engine.request import Request
from engine.analysis.check import ABSURD_NLL, MIN_TOKENS, Z_MIN, copy_fraction, nll_margin, nll_stats, verdict, z_score
from engine.events import RunResult
from engine.sampling_params import SamplingParams
from engine.setup import setup
from specconsole.suites import categories, load_suite

log = logging.getLogger("benchmarks.calibrate_check")


def run(backend: LocalBackend, req: Request, engine: str) -> RunResult:
    return [e for e in getattr(backend, engine)(req) if isinstance(e, RunResult)][-1]


def collect(args) -> list[dict]:
    backend = LocalBackend.from_preset(args.preset)
    pairs = []
    for category in args.categories or categories():
        for item in load_suite(category)[: args.prompts]:
            for temperature, max_new_tokens, seed in product(args.temperatures, args.max_new_tokens, range(args.seeds)):
                req = Request(prompt=item.prompt, earlier_turns=item.earlier_turns, max_new_tokens=max_new_tokens,
                              sampling=SamplingParams(temperature, 0, 1.0, 1000 + seed),
                              drafting=Drafting(method=args.method, k=4))
                b, s = run(backend, req, "baseline"), run(backend, req, "speculative")
                scores = backend.score(req, [b.output_ids, s.output_ids])
                pairs.append({"category": category, "temperature": temperature, "seed": seed,
                              "max_new_tokens": max_new_tokens,
                              "drafted": s.metrics.drafted, "accepted": s.metrics.accepted,
                              "copied": copy_fraction(item.prompt, b.output_text),
                              "baseline": scores[0], "speculative": scores[1]})
                log.info("%s T=%.1f seed %d: %d pairs", category, temperature, seed, len(pairs))
                if args.out:  # saved as it goes: a long calibration that is stopped keeps what it measured
                    Path(args.out).write_text(json.dumps(pairs))
    return pairs


def quantiles(values: list[float]) -> str:
    values = sorted(values)
    q = lambda p: values[min(len(values) - 1, int(p * len(values)))]  # noqa: E731
    return (f"median {statistics.median(values):+.2f}, 1% {q(0.01):+.2f}, 99% {q(0.99):+.2f}, "
            f"min {values[0]:+.2f}, max {values[-1]:+.2f}")


def report(pairs: list[dict]) -> str:
    """Per temperature: the NLL difference over lossless pairs, absurd tokens, and what the check would say."""
    lines = [f"{len(pairs)} lossless pairs (NLL difference = speculative - baseline, nats/token)"]
    for temperature in sorted({p["temperature"] for p in pairs}):
        group = [p for p in pairs if p["temperature"] == temperature]
        common = [min(len(p["baseline"]), len(p["speculative"])) for p in group]  # as the check compares them
        judged = [(nll_stats(p["baseline"][:m]), nll_stats(p["speculative"][:m])) for p, m in zip(group, common)
                  if m >= MIN_TOKENS]
        diffs = [s["mean"] - b["mean"] for b, s in judged]
        zs = [z_score(b, s) for b, s in judged]
        samples = [p[e] for p in group for e in ("baseline", "speculative")]
        absurd = sum(lp < -ABSURD_NLL for lps in samples for lp in lps)
        suspect = sum(verdict(p["baseline"], p["speculative"], temperature, p["drafted"], p["accepted"],
                              p["copied"])[0] == "suspect" for p in group)
        lines.append(f"T={temperature:g}: {len(group)} pairs; difference {quantiles(diffs)} "
                     f"(margin {nll_margin(temperature):.1f}); z {quantiles(zs)} (floor {Z_MIN:.0f}); "
                     f"tokens below e^-{ABSURD_NLL:.0f}: {absurd} of {sum(map(len, samples))}; "
                     f"called suspect: {suspect}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup()
    p = argparse.ArgumentParser(prog="python -m benchmarks.calibrate_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm2-ngram")
    p.add_argument("--method", default="ngram", choices=["draft", "ngram"])
    p.add_argument("--prompts", type=int, default=8, help="prompts per category")
    p.add_argument("--categories", nargs="+", help="suite categories (default: all)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.4, 0.7, 1.0, 1.2])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, nargs="+", default=[16, 64])
    p.add_argument("--out", help="save the scored pairs here (JSON)")
    p.add_argument("--load", nargs="+", help="report on pairs saved earlier (one or more files) instead of running")
    args = p.parse_args(argv)
    if args.load:
        pairs = [p for path in args.load for p in json.loads(Path(path).read_text())]
    else:
        pairs = collect(args)
    sys.stdout.write(report(pairs) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
