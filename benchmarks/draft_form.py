"""Candidate forms for the draft, side by side with the engines' own, drafting for the same target in one process:
- "int4 layers": weight-only int4 (groups of 32, the activations rounded to bfloat16 for torch's int4 kernel);
- "grouped int8 layers": the int8 target's own kernel (engine.exact.grouped_int8: codes in groups of 32, activations
  quantized per row and group);
- "grouped int4 layers": the same kernel on 4-bit codes (the int4 target's layers; 16 levels per group of 32 from the
  draft's float weights, which are not 4-bit in its GGUF);
each with the int8 output layer, against the engines' int8 draft (torch's dynamic int8 Linear everywhere,
engine.exact.optimize.quantize_linear). Measured on 2026-12-01 (int4) and 2026-12-02 (grouped int8), neither kept
(docs/memory.md#the-draft-in-int4-measured-not-kept); grouped int4 was kept beside an int4 target, as
engine.exact.optimize.Int4Draft (this script's Grouped4Linear with --max-rows 16).

    python -m benchmarks.draft_form --humaneval-prompts 4 --mtbench-prompts 4 --repeats 2
    python -m benchmarks.draft_form --max-rows 8          # passes of more rows (the prompt) on an int8 copy
    python -m benchmarks.draft_form --candidate grouped-int8 --precision int8 --max-rows 16
    python -m benchmarks.draft_form --candidate grouped-int4 --precision int4 --max-rows 16

Per prompt and repeat, the speculative engine runs once with each draft (the order alternating), greedy, hybrid
drafting as the default preset. Prints per draft: how often its greedy choice is the target's next token (teacher
forced on the target's own output), the acceptance rate, tokens per target pass, one draft step's ms, tok/s, and the
ratio of the two drafts' tok/s with a 95 % bootstrap interval over prompts. The two outputs must be the same (greedy
output equals the baseline's whatever the draft); a difference is logged and counted. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys

import torch
from torch import nn

from benchmarks.doc_table import machine
from benchmarks.speed import add_sample_args, run_engine, sample_plan
from benchmarks.timing import code_context, forward_ms_in_turns
from engine.analysis.stats import bootstrap_ci
from engine.exact.backend import LocalBackend
from engine.exact.forward import forward, new_cache
from engine.exact.optimize import quantize_linear
from engine.exact.precision import PRECISIONS
from engine.exact.models import load
from engine.presets import PRESETS
from engine.drafting import Drafting
from engine.request import Request
from engine.setup import setup

log = logging.getLogger("benchmarks.draft_form")
ENGINES_FORM = "int8 (the engines')"
CANDIDATES = {"int4": "int4 layers", "grouped-int8": "grouped int8 layers", "grouped-int4": "grouped int4 layers"}
GROUP = 32  # weights per int4 scale and offset, along the input dimension (a GGUF Q4/Q8 block's size)


class WideOnInt8(nn.Module):
    """A candidate draft layer whose passes of more than `max_rows` rows (the prompt) run on an int8 copy
    (engine.exact.optimize.quantize_linear), the rest on its own kernel (`narrow`); None: no copy, never."""

    def __init__(self, linear: nn.Linear, max_rows: int | None = None):
        super().__init__()
        self.in_features, self.out_features, self.max_rows = linear.in_features, linear.out_features, max_rows
        self.wide = quantize_linear(linear) if max_rows is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] float32
        if self.wide is not None and x.numel() > self.max_rows * self.in_features:
            return self.wide(x)
        return self.narrow(x)

    def narrow(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int4Linear(WideOnInt8):
    """Weight-only int4: each group of GROUP weights of an output row as 4-bit steps between its minimum and maximum;
    the activations rounded to bfloat16 (aten._weight_int4pack_mm_for_cpu is vectorized on x86 for bfloat16 only).
    The int4 kernel takes a row at a time, hence the int8 copy for long passes."""

    def __init__(self, linear: nn.Linear, max_rows: int | None = None):
        super().__init__(linear, max_rows)
        groups = linear.weight.detach().float().reshape(self.out_features, -1, GROUP)  # [N, K/G, G]
        low, high = groups.amin(-1), groups.amax(-1)  # [N, K/G]
        # the kernel computes (q - 8) * scale + offset, q in 0..15, scale and offset in bfloat16
        scale = ((high - low) / 15).clamp_min(torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
        offset = (low + 8 * scale.float()).to(torch.bfloat16)
        q = ((groups - offset.float()[..., None]) / scale.float()[..., None] + 8).round().clamp(0, 15)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).reshape(self.out_features, self.in_features), 1)  # [N, K/2] uint8
        self.scale_offset = torch.stack([scale.t(), offset.t()], dim=-1).contiguous()  # [K/G, N, 2]
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def narrow(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [R, in]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scale_offset).float()
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class GroupedLinear(WideOnInt8):
    """The int8 target's kernel for a draft layer (torch's int8 kernel is faster for many rows, hence the copy)."""

    four_bit = False  # Grouped4Linear: the int4 target's 4-bit codes, 16 levels per group from the float weights

    def __init__(self, linear: nn.Linear, max_rows: int | None = None):
        from engine.exact.grouped_int8 import GroupedInt4Linear, GroupedInt8Linear

        super().__init__(linear, max_rows)
        self.grouped = (GroupedInt4Linear if self.four_bit else GroupedInt8Linear)(linear)

    def narrow(self, x: torch.Tensor) -> torch.Tensor:
        return self.grouped(x)


class Grouped4Linear(GroupedLinear):
    four_bit = True


FORMS = {"int4": Int4Linear, "grouped-int8": GroupedLinear, "grouped-int4": Grouped4Linear}


def candidate_draft(model: nn.Module, form: type[WideOnInt8], max_rows: int | None) -> nn.Module:
    """The draft's layers in `form` where its kernel takes their shapes; the output layer stays int8."""
    head = model.get_output_embeddings()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                fits = child.in_features % GROUP == 0 and child.out_features % 16 == 0
                setattr(module, name, form(child, max_rows) if fits and child is not head
                        else quantize_linear(child))
    return model


def load_drafts(name: str, candidate: str, max_rows: int | None) -> dict:
    """The draft in the candidate form, and as the engines load it."""
    draft = load(name, "draft", int8=False)
    candidate_draft(draft.model, FORMS[candidate], max_rows)
    return {CANDIDATES[candidate]: draft, ENGINES_FORM: load(name, "draft", int8=True)}


def agreement(draft, prompt_ids: list[int], output: list[int]) -> float:
    """How often the draft's greedy next token is the target's, fed the target's own output."""
    logits = forward(draft.model, prompt_ids + output[:-1], new_cache(draft.model), keep=len(output))
    return float((logits.argmax(-1) == torch.tensor(output)).float().mean())


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    setup()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_sample_args(p, mtbench=4)
    p.set_defaults(humaneval_prompts=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--precision", default="float32", choices=PRECISIONS, help="the target's")
    p.add_argument("--candidate", default="int4", choices=CANDIDATES, help="the draft's form to try")
    p.add_argument("--max-rows", "--int4-max-rows", dest="max_rows", type=int,
                   help="the candidate's passes of more rows run on an int8 copy (default: none do)")
    args = p.parse_args(argv)
    preset = PRESETS["qwen-coder"]
    plan = sample_plan(args)

    target = load(preset.target, "target", precision=args.precision)
    drafts = load_drafts(preset.draft, args.candidate, args.max_rows)
    forms = list(drafts)  # the candidate, then the engines' form
    backends = {form: LocalBackend(target, d) for form, d in drafts.items()}
    with torch.inference_mode():
        context = code_context(target.tokenizer, 200)
        step_ms = {form: statistics.median(forward_ms_in_turns(
            d.model, context, {1: lambda cache, m=d.model: forward(m, context[:1], cache, keep=1)}, 15, 2)[1])
            for form, d in drafts.items()}
    requests = [Request(prompt=item.prompt, earlier_turns=item.earlier_turns, max_new_tokens=args.max_new_tokens,
                        drafting=Drafting(method=preset.method)) for _, item in plan]
    for b in backends.values():  # warm-up
        run_engine(b, "speculative", Request(prompt="Hello", max_new_tokens=8, drafting=Drafting(method=preset.method)))

    rows = {form: [[] for _ in plan] for form in forms}
    differ: set[int] = set()
    outs: list[list[int]] = [[] for _ in plan]
    for r in range(args.repeats):
        for i, req in enumerate(requests):
            outputs = {}
            for form in forms if (r + i) % 2 == 0 else forms[::-1]:
                s = run_engine(backends[form], "speculative", req)
                outputs[form] = s.output_ids
                rows[form][i].append({"tps": s.metrics.tokens_per_s, "acceptance": s.metrics.acceptance_rate,
                                      "per_pass": len(s.output_ids) / max(1, len(s.steps))})
            if len(set(map(tuple, outputs.values()))) > 1:
                differ.add(i)
                log.warning("prompt %d: the two drafts' outputs differ (greedy output must not depend on the draft)",
                            i + 1)
            outs[i] = outputs[forms[0]]
            log.info("repeat %d, prompt %d: %s", r + 1, i + 1,
                     {f: round(rows[f][i][-1]["tps"], 2) for f in forms})
    with torch.inference_mode():  # agreement, teacher forced on the target's output (greedy: the baseline's)
        ids = [backends[forms[0]].prompt_ids(req) for req in requests]
        agree = {form: [agreement(d, pi, o) for pi, o in zip(ids, outs)] for form, d in drafts.items()}

    med = statistics.median
    per_prompt = {form: [{k: med(x[k] for x in reps) for k in reps[0]} for reps in rows[form]] for form in forms}
    out = sys.stdout
    wide = "" if args.max_rows is None else f", candidate passes of more than {args.max_rows} rows on int8"
    out.write(f"\nDraft forms{wide}: {preset.draft} for {target.name}; {len(plan)} prompts "
              f"(HumanEval {args.humaneval_prompts}, MT-Bench {args.mtbench_prompts}, seed {args.sample_seed}), "
              f"{args.repeats} repeats, {args.max_new_tokens} new tokens, greedy, {preset.method} drafting; medians "
              f"over prompts; machine: {machine()}\n\n")
    out.write("| draft | agrees with the target | acceptance | tokens per target pass | draft step ms | tok/s |\n"
              "| --- | --- | --- | --- | --- | --- |\n")
    for form in forms:
        pp = per_prompt[form]
        out.write(f"| {form} | {med(agree[form]):.2f} | {med(x['acceptance'] for x in pp):.2f} | "
                  f"{med(x['per_pass'] for x in pp):.2f} | {step_ms[form]:.1f} | {med(x['tps'] for x in pp):.2f} |\n")
    ratio = [a["tps"] / b["tps"] for a, b in zip(per_prompt[forms[0]], per_prompt[forms[1]])]
    point, low, high = bootstrap_ci(ratio)
    out.write(f"\ntok/s {forms[0]} / {forms[1]}: {point:.2f} [{low:.2f}, {high:.2f}] (per prompt: "
              + ", ".join(f"{x:.2f}" for x in ratio) + f"); outputs identical on {len(plan) - len(differ)}/{len(plan)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
