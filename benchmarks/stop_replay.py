"""Draft-stop rules replayed on recorded greedy outputs: which rule drafts best, without the machine's timing noise.

    python -m benchmarks.stop_replay                         16 MT-Bench prompts (2 per category), sample seed 0
    python -m benchmarks.stop_replay --mtbench-prompts 32 --humaneval-prompts 8

Under greedy decoding a step's outcome is fixed by the text: the target's output is the baseline's, and what the
draft model proposes after a committed prefix is its greedy continuation. So per prompt the script records once the
baseline's output and, after every prefix of it, the draft's continuation with the draft's confidence in each token.
Each rule then replays on that record: how many tokens a step drafts, how many of them the target accepts (the
longest prefix that equals the output), and the step's modelled time, drafted x (draft ms per token) + verify(m),
with verify(m) measured on this machine (benchmarks.pass_cost's timing) and the draft's ms per token measured while
recording. Machine noise, per-step overhead and the prefill are left out: the replay compares the rules, not the
engines' code, and its figures are a model, not a measurement of speed (that is benchmarks.speed).

    hf         HF assisted generation's rule: draft while the draft's confidence stays at 0.4 or more (the token
               below it is still proposed), up to 20 tokens
    ours       the default's: hybrid lookup, then SpecPolicy's per-token stop and draft-length cap, with verify(m)
               known for every m (as after a process has seen every length)
    ours-cold  the same, learning verify(m) from its own steps (a process's first run)

Prints per prompt and per category the target passes and the modelled ms per token of each rule, and ours/HF (HF's
modelled time / ours): the median, with a 95 % bootstrap interval over prompts.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from benchmarks.pass_cost import pass_ms
from benchmarks.doc_table import machine
from benchmarks.speed import add_sample_args, describe_prompts, sample_plan, with_ci
from benchmarks.timing import code_context
from engine.exact.proposers import DraftModelProposer, HybridProposer
from engine.events import StepRecord
from engine.exact.decode import generate_baseline
from engine.exact.backend import LocalBackend
from engine.exact.policy import PolicyConfig, SpecPolicy
from engine.presets import DEFAULT_PRESET, PRESETS
from engine.prompts import encode_prompt
from engine.request import DEFAULT_DRAFT_CONFIDENCE, build_request
from engine.sampling_params import SamplingParams
from engine.setup import setup
from engine.stops import StopConditions

log = logging.getLogger("benchmarks.stop_replay")

FLOOR = DEFAULT_DRAFT_CONFIDENCE  # 0.4, as HF assisted generation's assistant_confidence_threshold
HF_MAX_DRAFT = 20  # HF assisted generation's num_assistant_tokens
PAST_FLOOR = 6  # draft tokens recorded past the first one below the floor: a rule may draft on where passes are cheaper


@dataclass
class Trace:
    """One prompt's record: the target's greedy output and the draft's greedy continuation after each prefix."""

    category: str
    context: list[int]  # the prompt's ids
    output: list[int]  # the baseline's greedy output
    drafts: list[list[int]]  # drafts[i]: the draft's continuation after context + output[:i]
    confidence: list[list[float]]  # the draft's probability of each of those tokens


class _Recorder:
    """A DraftStop stand-in for DraftModelProposer.propose: notes each draft token's confidence, and lets the draft go
    on until PAST_FLOOR tokens follow the first one below the floor."""

    def __init__(self):
        self.confidence: list[float] = []

    def more(self, confidence: float) -> bool:
        self.confidence.append(confidence)
        first = next((j for j, c in enumerate(self.confidence) if c < FLOOR), None)
        return first is None or len(self.confidence) <= first + PAST_FLOOR


def record(target, draft, tokenizer, category: str, context: list[int], max_new_tokens: int,
           eos_ids: frozenset[int] = frozenset(), depth: int = HF_MAX_DRAFT) -> tuple[Trace, list[float]]:
    """The trace of one prompt, and the draft's ms per drafted token of each continuation recorded. The output ends
    where the engines' would: at an end-of-sequence token or after max_new_tokens. The continuations come from the
    engine's own greedy draft loop (DraftModelProposer), which keeps its KV cache across prefixes."""
    stops = StopConditions(max_new_tokens, eos_ids)
    *_, run = generate_baseline(target, tokenizer, context, SamplingParams(), stops)
    output = run.output_ids
    proposer = DraftModelProposer(draft, target.config.vocab_size, SamplingParams(), None)
    drafts, confidence, ms = [], [], []
    for i in range(len(output)):
        recorder, prefix = _Recorder(), context + output[:i]
        proposer.update(prefix[:-1])  # the engine always feeds at least the newest token: never an empty feed
        start = time.perf_counter()
        drafts.append(proposer.propose(prefix, depth, recorder).ids)
        ms.append(1000 * (time.perf_counter() - start) / len(drafts[-1]))
        confidence.append(recorder.confidence)
    return Trace(category, context, output, drafts, confidence), ms


def accepted(drafts: list[int], output: list[int], i: int) -> int:
    """How many drafts after output[:i] a greedy target keeps: the longest prefix equal to the output."""
    n = 0
    while n < len(drafts) and i + n < len(output) and drafts[n] == output[i + n]:
        n += 1
    return n


def floor_drafts(trace: Trace, i: int, budget: int, k: int = HF_MAX_DRAFT,
                 floor: float = FLOOR) -> tuple[list[int], str]:
    """Up to k drafts, through the first one below `floor` (as DraftModelProposer.propose without a DraftStop). With
    its defaults this is HF assisted generation's rule: up to 20 tokens, ending at one below 0.4."""
    n = 0
    for c in trace.confidence[i][:min(k, budget)]:
        n += 1
        if c < floor:
            break
    return trace.drafts[i][:n], "draft"


class Ours:
    """The default preset's drafting with the page's default settings, its decisions made by the real SpecPolicy and
    DraftStop from the modelled step costs. With `known`, verify(m) is the measured curve from the start."""

    def __init__(self, curve: dict[int, float], known: bool):
        d = build_request("-", method=PRESETS[DEFAULT_PRESET].method).drafting
        self.policy = SpecPolicy(PolicyConfig.of(d), target_step_ms=curve[1], verify_ms=dict(curve) if known else {})
        self.lookup = HybridProposer.lookup_for(d)  # as the backend

    def __call__(self, trace: Trace, i: int, budget: int) -> tuple[list[int], str]:
        """The drafts of the step after output[:i], and who drafted them, as HybridProposer.propose would."""
        k = min(self.policy.next_k(), budget)
        if k == 0:
            return [], ""
        look = self.lookup.propose(trace.context + trace.output[:i], k).ids
        if look:
            return look, "ngram"
        stop, n = self.policy.draft_stop(), 0
        for c in trace.confidence[i][:k]:  # as DraftModelProposer.propose
            n += 1
            unsure = c < FLOOR
            if stop is None and unsure or stop is not None and not stop.more(0.0 if unsure else c):
                break
        return trace.drafts[i][:n], "draft"

    def observe(self, step: StepRecord) -> None:
        self.policy.observe(step)


def replay(trace: Trace, rule, curve: dict[int, float], draft_ms: float) -> tuple[float, int]:
    """Modelled ms and target passes of one request. Step 0 drafts from the prompt, and its target pass reads the
    prompt with the drafts (as the engines do): the prefill, whose time is left out for every rule."""
    i, total, step = 0, 0.0, 0
    while i < len(trace.output):
        drafts, drafter = rule(trace, i, len(trace.output) - i - 1)  # a step commits up to drafts + 1
        a = accepted(drafts, trace.output, i)
        ms_draft = len(drafts) * draft_ms if drafter == "draft" else 0.0  # a lookup costs next to nothing
        ms_verify = curve[len(drafts) + 1] if step else 0.0
        total += ms_draft + ms_verify
        if hasattr(rule, "observe"):
            rule.observe(StepRecord(step, len(drafts), a, a + 1, ms_draft, ms_verify, 0.0, drafter))
        step += 1
        i += a + 1
    return total, step


RULES = {"hf": lambda curve: floor_drafts, "ours": lambda curve: Ours(curve, known=True),
         "ours-cold": lambda curve: Ours(curve, known=False)}


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    setup()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_sample_args(p)
    p.add_argument("--rounds", type=int, default=5, help="timed target passes per length m for verify(m)")
    args = p.parse_args(argv)
    plan = sample_plan(args)

    backend = LocalBackend.from_preset(DEFAULT_PRESET)  # with the engine's optimisations
    target, draft, tokenizer = backend.target.model, backend.draft.model, backend.target.tokenizer
    sizes = list(range(1, HF_MAX_DRAFT + 2))  # m = drafts + 1, up to HF's longest draft
    log.info("timing one target pass over m = 1..%d tokens, %d rounds", sizes[-1], args.rounds)
    times = pass_ms(target, code_context(tokenizer, 200), sizes, args.rounds)
    curve = {m: statistics.median(t) for m, t in times.items()}
    traces, draft_times = [], []  # draft ms per drafted token, as the engine counts it (catch-up included)
    with torch.inference_mode():
        for _, item in tqdm(plan, desc="recording outputs and draft continuations", unit="prompt"):
            context = encode_prompt(tokenizer, item.prompt, True, item.earlier_turns)
            trace, ms = record(target, draft, tokenizer, item.category, context, args.max_new_tokens,
                               backend.target.eos_ids)
            traces.append(trace)
            draft_times += ms
    draft_ms = statistics.median(draft_times)

    rows = []  # per prompt: {rule: (ms per token, passes)}
    for trace in traces:
        row = {}
        for name, make in RULES.items():
            total, passes = replay(trace, make(curve), curve, draft_ms)
            row[name] = (total / len(trace.output), passes)
        rows.append(row)

    out = sys.stdout
    out.write(f"\nDraft-stop rules replayed (a model of the time, not a measurement): "
              f"{describe_prompts(plan, args.sample_seed)}; greedy, {args.max_new_tokens} new tokens; default preset; "
              f"{machine()}; "
              f"{time.strftime('%Y-%m-%d %H:%M')}.\nverify(m) in ms, median of {args.rounds} passes: "
              + ", ".join(f"{m}: {v:.0f}" for m, v in curve.items()) + f"; draft {draft_ms:.1f} ms per token.\n\n")
    out.write("| prompt | category | tokens | passes HF / ours / cold | ms per token HF / ours / cold | ours/HF | "
              "cold/HF |\n| --- | --- | --- | --- | --- | --- | --- |\n")
    for n, (trace, row) in enumerate(zip(traces, rows), 1):
        ms = " / ".join(f"{row[r][0]:.0f}" for r in RULES)
        passes = " / ".join(str(row[r][1]) for r in RULES)
        out.write(f"| {n} | {trace.category} | {len(trace.output)} | {passes} | {ms} | "
                  f"{row['hf'][0] / row['ours'][0]:.2f} | {row['hf'][0] / row['ours-cold'][0]:.2f} |\n")
    out.write("\n| category | prompts | ours/HF [95% CI] | cold/HF [95% CI] |\n| --- | --- | --- | --- |\n")
    groups: dict[str, list[int]] = {}
    for n, trace in enumerate(traces):
        groups.setdefault(trace.category, []).append(n)
    groups["all"] = list(range(len(traces)))
    for name, members in groups.items():
        ours = [rows[n]["hf"][0] / rows[n]["ours"][0] for n in members]
        cold = [rows[n]["hf"][0] / rows[n]["ours-cold"][0] for n in members]
        out.write(f"| {name} | {len(members)} | {with_ci(ours, '{:.2f}')} | {with_ci(cold, '{:.2f}')} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
