"""What the engine process's boundary costs: per target pass, the time a run spends outside the engine's own clock.

    python -m benchmarks.process_cost [--preset qwen-coder] [--runs 8] [--max-new-tokens 128]

The console's engines (launch.py's local backend: the preset, int4 where its kernel runs, the page's defaults) in
their engine process (engine.process), driven as fair mode drives them: one pass per round trip over the pipe. Each
run's clock in the engine process runs only while the stream computes, so the wall time the console waits beyond it
is the boundary: the round trip, pickling the pass's events, and waking the threads on both sides. Prints, per
engine, the median ms per pass and per output token of that boundary with a 95 % interval over the runs, and its
share of the run, and replaces this machine's table in docs/design.md. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import sys
import time

from benchmarks.doc_table import machine_kind, write_table
from engine.analysis.stats import bootstrap_ci
from engine.setup import setup

log = logging.getLogger("benchmarks.process_cost")
PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."


def one_run(backend, engine: str, req) -> dict:
    """Drive one engine's stream pass by pass, as fair mode does; its boundary per pass and per token."""
    stream = backend.baseline(req) if engine == "baseline" else backend.speculative(req)
    t = time.perf_counter()
    result = None
    for event in stream:
        result = event
    wall = time.perf_counter() - t
    passes, tokens = len(result.steps), len(result.output_ids)
    outside_ms = 1000 * (wall - result.total_s)
    return {"per_pass_ms": outside_ms / passes, "per_token_ms": outside_ms / tokens, "share": outside_ms / 1000 / wall,
            "tokens_per_s": result.metrics.tokens_per_s}


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    setup()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=8, help="runs per engine, after a warm-up run each")
    p.add_argument("--max-new-tokens", type=int, default=128, help="the page's own default")
    args, rest = p.parse_known_args(argv)
    from specconsole import cli
    from benchmarks.doc_table import machine
    from engine.request import build_request
    from specconsole.backends import backend_host

    parser = argparse.ArgumentParser(prog="launch.py")
    cli.add_engine_args(parser)
    cli.add_backend_args(parser)
    largs = parser.parse_args(rest)
    host = backend_host(largs).start()
    try:
        if not host.wait():
            log.error("%s", host.status())
            return 2
        req = build_request(PROMPT, max_new_tokens=args.max_new_tokens, method=host.method)  # the page's defaults
        rows = {"baseline": [], "speculative": []}
        for i in range(args.runs + 1):
            for engine, kept in rows.items():
                row = one_run(host.backend, engine, req)
                if i:
                    kept.append(row)
        out = io.StringIO()
        command = " ".join(["python -m benchmarks.process_cost", *(argv if argv is not None else sys.argv[1:])])
        out.write(f"\n#### {machine_kind()}: what the boundary costs\n\n`{command}`: {host.label}; "
                  f"{args.max_new_tokens} new tokens, greedy, {args.runs} runs per engine after a warm-up; machine: "
                  f"{machine()}; {time.strftime('%Y-%m-%d %H:%M')}\n\n")
        out.write("| engine | ms per pass | ms per output token | share of the run | tok/s |\n"
                  "| --- | --- | --- | --- | --- |\n")
        for engine, kept in rows.items():
            cells = []
            for key, form in (("per_pass_ms", ".3f"), ("per_token_ms", ".3f"), ("share", ".4f")):
                point, low, high = bootstrap_ci([r[key] for r in kept])
                cells.append(f"{point:{form}} [{low:{form}}, {high:{form}}]")
            tps = statistics.median(r["tokens_per_s"] for r in kept)
            out.write(f"| {engine} | {' | '.join(cells)} | {tps:.1f} |\n")
        sys.stdout.write(out.getvalue())
        write_table("design.md", f"process cost / {machine_kind()}", out.getvalue())
        return 0
    finally:
        host.close()


if __name__ == "__main__":
    sys.exit(main())
