"""Micro-benchmark of FR-Spec's pruned draft head (engine.exact.vocab): one draft step, full output layer vs pruned.

    python -m benchmarks.draft_head                      # the default draft: Qwen2.5-Coder-0.5B, int8
    python -m benchmarks.draft_head --sizes 8192 32768 --steps 100

Loads the draft once. Timing: a warm KV cache of --context tokens (the start of engine/exact/proposers.py: code and
English), then one token per step, the cache cropped back after each; the configurations take turns step by step,
so that a drift in the machine's speed favours none. Coverage: the draft's own greedy continuations of the first
prompt of a few in-repo suites (not HumanEval / MT-Bench), full layer; per position the share of the draft's
probability mass on the kept tokens, and how many of its greedy tokens are kept. On a shared machine the times are
noisy; the coverage is not.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch

from benchmarks.timing import code_context, forward_ms_in_turns
from engine.exact.forward import forward, new_cache
from engine.exact.models import load
from engine.prompts import encode_prompt
from engine.setup import setup
from engine.exact.vocab import kept_ids, prune_head, token_ranking

log = logging.getLogger("draft_head")
DRAFT = "qwen2.5-coder-0.5b-instruct"
COVERAGE_SUITES = ("code", "chat", "summarization")


def step_ms(model, heads: dict, context: list[int], steps: int) -> dict[int, float]:
    """Median ms of one draft step (1 token after `context`) per head; the heads take turns."""
    configs = {n: (lambda cache, head=head: forward(model, context[-1:], cache, keep=1, head=head))
               for n, head in heads.items()}
    times = forward_ms_in_turns(model, context[:-1], configs, steps, warmup=3)
    return {n: statistics.median(ts) for n, ts in times.items()}


def coverage(model, tokenizer, prompts: list[str], kept: dict[int, torch.Tensor], tokens: int) -> dict[int, tuple]:
    """Per N: (mean probability mass on the kept ids, share of greedy tokens that are kept) over the draft's own
    greedy continuations of `prompts`."""
    mass: dict[int, list[float]] = {n: [] for n in kept}
    hits: dict[int, list[bool]] = {n: [] for n in kept}
    for prompt in prompts:
        cache = new_cache(model)
        feed = encode_prompt(tokenizer, prompt)
        for _ in range(tokens):
            probs = torch.softmax(forward(model, feed, cache, keep=1)[-1], -1)
            token = int(probs.argmax())
            for n, ids in kept.items():
                mass[n].append(float(probs[ids].sum()))
                hits[n].append(bool((ids == token).any()))
            feed = [token]
    return {n: (statistics.mean(mass[n]), statistics.mean(hits[n])) for n in kept}


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    setup()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draft", default=DRAFT, help="draft model (a known name, a directory or a .gguf file)")
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768, 65536], help="kept vocabulary sizes N")
    p.add_argument("--context", type=int, default=200, help="tokens in the KV cache when a step is timed")
    p.add_argument("--steps", type=int, default=60, help="timed steps per configuration")
    p.add_argument("--coverage-tokens", type=int, default=48, help="greedy tokens per prompt (0: no coverage)")
    args = p.parse_args(argv)

    from specconsole.suites import load_suite

    draft = load(args.draft, "draft", int8=True)
    model, tokenizer = draft.model, draft.tokenizer
    t = time.perf_counter()
    ranking = token_ranking(tokenizer)
    log.info("token ranking ready in %.1f s", time.perf_counter() - t)
    kept = {n: kept_ids(ranking, n, draft.vocab_size) for n in args.sizes}
    heads: dict = {0: None}
    for n, ids in kept.items():
        t = time.perf_counter()
        heads[n] = prune_head(model.get_output_embeddings(), ids)
        log.info("pruned head N=%d built in %.2f s", n, time.perf_counter() - t)

    context = code_context(tokenizer, args.context)
    ms = step_ms(model, heads, context, args.steps)
    cov = {}
    if args.coverage_tokens:
        prompts = [load_suite(s)[0].prompt for s in COVERAGE_SUITES]
        cov = coverage(model, tokenizer, prompts, kept, args.coverage_tokens)

    out = sys.stdout
    out.write(f"\nDraft {draft.name} (int8 on CPU), vocabulary {draft.vocab_size}; one draft step after "
              f"{len(context)} cached tokens, median of {args.steps}; {torch.get_num_threads()} threads.\n\n")
    out.write("| draft vocabulary | ms / step | vs full | probability mass kept | greedy tokens kept |\n")
    out.write("| --- | --- | --- | --- | --- |\n")
    for n, value in ms.items():
        mass, hit = cov.get(n, (None, None))
        cells = ["full" if n == 0 else str(n), f"{value:.2f}", f"{ms[0] / value:.2f}x",
                 "1" if n == 0 else (f"{mass:.4f}" if mass is not None else "n/a"),
                 "1" if n == 0 else (f"{hit:.3f}" if hit is not None else "n/a")]
        out.write("| " + " | ".join(cells) + " |\n")
    if cov:
        out.write(f"\nCoverage: the draft's own greedy continuations ({args.coverage_tokens} tokens) of the first "
                  f"prompt of the in-repo suites {', '.join(COVERAGE_SUITES)}.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
