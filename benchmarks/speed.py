"""Speed benchmark: our baseline vs our speculative engine vs Hugging Face assisted generation, per category.

    python -m benchmarks.speed [--preset qwen-coder] [--categories code json_sql] [--prompts 2] [--repeats 3]

All four runs of a prompt use the same two model objects with the same optimisations (prepacked float32 target,
int8 draft on CPU), greedy decoding, the chat template and the same token budget. Every figure is the median over
the repeats of the ratio measured within one repeat. Prints a table per category; nothing here is a test.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch

from engine.backend import LocalBackend, Request
from engine.events import RunResult
from engine.metrics import compare, first_divergence
from engine.models import PRESETS, encode_prompt
from specconsole.suites import categories, load_suite

log = logging.getLogger("benchmarks.speed")


class PassCounter:
    """Counts target forward passes (to check how many steps HF assisted generation really took)."""

    def __init__(self, model):
        self.count = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.count += 1


def run_engine(backend, engine: str, req: Request) -> RunResult:
    *_, result = getattr(backend, engine)(req)
    if result.error:
        raise RuntimeError(f"{engine} failed: {result.error}")
    return result


def run_hf(backend, req: Request, assisted: bool, counter: PassCounter) -> tuple[list[int], float, int]:
    t = backend.target
    ids = torch.tensor([encode_prompt(t.tokenizer, req.prompt)], device=t.device)
    kwargs = dict(
        max_new_tokens=req.max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
        eos_token_id=sorted(t.eos_ids), pad_token_id=t.tokenizer.pad_token_id or sorted(t.eos_ids)[0],
    )
    if assisted:
        kwargs["assistant_model"] = backend.draft.model
    counter.count = 0
    start = time.perf_counter()
    with torch.inference_mode():
        out = t.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    seconds = time.perf_counter() - start
    return out[0, ids.shape[1]:].tolist(), seconds, counter.count


def bench_prompt(backend, req: Request, counter: PassCounter) -> dict:
    b = run_engine(backend, "baseline", req)
    s = run_engine(backend, "speculative", req)
    hf_ids, hf_s, _ = run_hf(backend, req, False, counter)
    hfa_ids, hfa_s, hfa_passes = run_hf(backend, req, True, counter)
    c = compare(b, s, greedy=True)
    hf_speedup = (len(hfa_ids) / hfa_s) / (len(hf_ids) / hf_s)
    return {
        "baseline_tps": b.metrics["tokens_per_s"],
        "spec_tps": s.metrics["tokens_per_s"],
        "speedup": c["speedup"],
        "acceptance": s.metrics["acceptance_rate"] or 0.0,
        "mean_accepted_length": s.metrics["mean_accepted_length"] or 1.0,
        "bound": c.get("machine_bound", float("nan")),
        "efficiency": c.get("efficiency", float("nan")),
        "hf_speedup": hf_speedup,
        "ours_vs_hf": c["speedup"] / hf_speedup,
        "identical": c["identical"],
        "hf_identical": first_divergence(b.output_ids, hfa_ids) is None,
        "hf_target_passes": hfa_passes,
        "our_target_passes": s.metrics["target_passes"],
        "tokens": len(b.output_ids),
    }


COLUMNS = [
    ("baseline_tps", "base tok/s", "{:.2f}"), ("spec_tps", "spec tok/s", "{:.2f}"), ("speedup", "speedup", "{:.2f}x"),
    ("acceptance", "accept", "{:.2f}"), ("mean_accepted_length", "mean len", "{:.2f}"),
    ("bound", "bound", "{:.2f}x"), ("efficiency", "effic.", "{:.2f}"), ("hf_speedup", "HF asst", "{:.2f}x"),
    ("ours_vs_hf", "ours/HF", "{:.2f}"),
]


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="qwen-coder", choices=sorted(PRESETS))
    p.add_argument("--categories", nargs="*", default=categories())
    p.add_argument("--prompts", type=int, default=2, help="prompts per category (the first N of each suite)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--fixed-k", action="store_true", help="constant K instead of dynamic K")
    p.add_argument("--confidence", type=float, default=0.4, help="draft stops below this probability (0 = off)")
    p.add_argument("--no-per-token", action="store_true", help="dynamic K from the i.i.d. model, no per-token stop")
    p.add_argument("--strict", action="store_true")
    args = p.parse_args(argv)

    backend = LocalBackend.from_preset(args.preset, strict=args.strict)
    counter = PassCounter(backend.target.model)
    method = PRESETS[args.preset].method
    dg = backend.draft.model.generation_config if backend.draft else None
    log.info("HF assisted generation: num_assistant_tokens=%s schedule=%s confidence=%s",
             getattr(dg, "num_assistant_tokens", None), getattr(dg, "num_assistant_tokens_schedule", None),
             getattr(dg, "assistant_confidence_threshold", None))
    warm = Request(prompt="Hello", max_new_tokens=8, method=method, k=args.k)
    run_engine(backend, "baseline", warm)  # first calls pay one-off costs; also measures the target's step
    run_engine(backend, "speculative", warm)

    rows = {}
    for category in args.categories:
        per_prompt = []
        for item in load_suite(category)[: args.prompts]:
            req = Request(prompt=item.prompt, max_new_tokens=args.max_new_tokens, method=method, k=args.k,
                          dynamic_k=not args.fixed_k, draft_confidence=args.confidence,
                          per_token=not args.no_per_token)
            reps = []
            for r in range(args.repeats):
                reps.append(bench_prompt(backend, req, counter))
                log.info("%s rep %d: speedup %.2fx (HF %.2fx), identical=%s", category, r + 1,
                         reps[-1]["speedup"], reps[-1]["hf_speedup"], reps[-1]["identical"])
            per_prompt.append({k: statistics.median(x[k] for x in reps) for k, *_ in COLUMNS}
                              | {"identical": all(x["identical"] for x in reps),
                                 "hf_identical": all(x["hf_identical"] for x in reps)})
        rows[category] = {k: statistics.median(x[k] for x in per_prompt) for k, *_ in COLUMNS} | {
            "identical": f"{sum(x['identical'] for x in per_prompt)}/{len(per_prompt)}",
            "hf_identical": f"{sum(x['hf_identical'] for x in per_prompt)}/{len(per_prompt)}",
        }

    out = sys.stdout
    kind = "fixed K=%d" % args.k if args.fixed_k else "dynamic K" + ("" if args.no_per_token else ", per-token stop")
    out.write(f"\npreset {args.preset}, {kind}, greedy, {args.max_new_tokens} new tokens, "
              f"medians over {args.repeats} repeats x {args.prompts} prompts\n")
    header = ["category"] + [h for _, h, _ in COLUMNS] + ["identical", "HF ident."]
    out.write(" | ".join(header) + "\n" + " | ".join("---" for _ in header) + "\n")
    for category, row in rows.items():
        cells = [category] + [fmt.format(row[k]) for k, _, fmt in COLUMNS] + [row["identical"], row["hf_identical"]]
        out.write(" | ".join(cells) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
