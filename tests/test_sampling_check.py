"""The sampling check (engine.analysis.check) on the local backend: scoring, verdicts, and where the verdict shows up (page
figures, history, CSV, workbench aggregate). Tiny models: the real-vLLM side is in test_vllm_real.py."""

import pandas as pd
import torch

from engine.drafting import Drafting
from engine.request import Request
from engine.analysis.check import ABSURD_NLL, COPY_FRACTION, MIN_DRAFTS, copy_fraction, sampling_check, verdict
from engine.comparison import ComparisonFigures
from engine.events import RunResult
from engine.exact.forward import forward, new_cache
from engine.metrics import compare
from engine.run_metrics import RunMetrics
from engine.sampling_params import SamplingParams
from specconsole.export import export_csv
from specconsole.history import History
from specconsole.render import figures_html
from specconsole.runner import Comparison
from specconsole.workbench import aggregate, runs_frame

PROMPT = "Write a short note about rivers."


def sampled(temperature: float, seed: int, max_new_tokens: int = 24) -> Request:
    return Request(prompt=PROMPT, max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature, 0, 1.0, seed),
                   drafting=Drafting(method="draft", k=3))


def result(backend, engine: str, req: Request) -> RunResult:
    return list(getattr(backend, engine)(req))[-1]


def test_score_is_the_targets_log_softmax(backend):
    req = sampled(0.8, 1)
    outputs = [result(backend, "baseline", req).output_ids, result(backend, "speculative", req).output_ids]
    scores = backend.score(req, outputs)
    prompt = backend.prompt_ids(req)
    for out, got in zip(outputs, scores):
        logits = forward(backend.target.model, prompt + out, new_cache(backend.target.model), keep=len(out) + 1)
        want = torch.log_softmax(logits[:-1], -1)[torch.arange(len(out)), torch.tensor(out)]
        assert len(got) == len(out) and torch.allclose(torch.tensor(got), want, atol=1e-3)


def test_lossless_runs_pass_and_the_verdict_is_saved_and_exported(backend, tmp_path):
    history = History(tmp_path / "h.db")
    meta = {"category": "chat", "backend": "local", "method": "draft", "suite_id": "s1"}
    ids = []
    for seed in range(3):
        comp = Comparison(backend, sampled(0.7, seed), "fair", history, meta)
        comp.start()
        while not comp.poll(0.05):
            pass
        c = comp.checks()["speculative"]
        assert c["sampling_check"] == "ok", c["sampling_check_reason"]
        assert c["nll_baseline"] > 0 and c["nll_speculative"] > 0 and c["perplexity_baseline"] > 1
        assert "sampling check" in figures_html(*comp.results.values(), comp.comparison(), "fair", None, c)
        row = history.run(comp.run_id)
        assert row["sampling_check"] == "ok" and row["nll_speculative"] == c["nll_speculative"]
        ids.append(comp.run_id)
    runs_csv, _ = export_csv(history, tmp_path / "csv", ids)
    exported = pd.read_csv(runs_csv)
    assert list(exported["sampling_check"]) == ["ok"] * 3 and exported["nll_baseline"].notna().all()
    assert aggregate(runs_frame(history, "s1"))["sampling_check"].tolist() == ["0 suspect of 3"]


def test_a_sampler_that_ignores_the_temperature_is_suspect(backend):
    """A speculative engine that samples from another distribution than the request's (here: temperature 5 where
    0.5 was asked for, like a server whose per-token temperature is garbage) is caught by its likelihood."""
    req = sampled(0.5, 3, max_new_tokens=32)
    results = {"baseline": result(backend, "baseline", req),
               "speculative": result(backend, "speculative", sampled(5.0, 3, max_new_tokens=32))}
    c = sampling_check(backend, req, results)
    assert c["sampling_check"] == "suspect" and c["nll_speculative"] > c["nll_baseline"] + 1
    html = figures_html(results["baseline"], results["speculative"], compare(*results.values(), False), "fair", None,
                        c)
    assert "✖ suspect" in html and "far less likely" in html


def test_greedy_and_unfinished_runs_are_not_checked(backend):
    req = Request(prompt=PROMPT, max_new_tokens=8, drafting=Drafting(method="draft", k=3))
    results = {e: result(backend, e, req) for e in ("baseline", "speculative")}
    assert sampling_check(backend, req, results) == {"sampling_check": None}
    results["speculative"].finish_reason = "cancelled"
    assert sampling_check(backend, sampled(0.7, 1), results)["sampling_check"] is None


def test_absurd_tokens_and_zero_acceptance_on_a_copying_prompt():
    fine = [-0.5] * 30
    assert verdict(fine, fine, 1.2, 40, 10, 0.9)[0] == "ok"
    absurd = [-0.5] * 26 + [-(ABSURD_NLL + 5)] * 4  # likely on average at T=1.2, but 4 tokens no sampler picks
    status, reason = verdict(fine, absurd, 1.2, 40, 10, 0.9)
    assert status == "suspect" and "4 of 30" in reason
    # such a token in the baseline's output too: this target samples them itself, and the rule says nothing
    assert verdict(fine[:-1] + [-(ABSURD_NLL + 1)], fine[:-1] + [-(ABSURD_NLL + 1)], 1.2, 40, 10, 0.9)[0] == "ok"
    assert verdict(fine, absurd, 1.5, 40, 10, 0.9)[0] == "ok"  # above the calibrated temperatures: not judged
    status, reason = verdict(fine, fine, 0.7, MIN_DRAFTS, 0, COPY_FRACTION)
    assert status == "suspect" and f"acceptance 0.00 over {MIN_DRAFTS} drafts" in reason
    assert verdict(fine, fine, 0.7, MIN_DRAFTS, 1, 1.0)[0] == "ok"  # one accepted draft: not the broken case
    assert verdict(fine, fine, 0.7, MIN_DRAFTS, 0, 0.1)[0] == "ok"  # a prompt it does not copy from


def test_copy_fraction():
    prompt = 'Repeat this JSON exactly: {"name": "Ada", "id": 42}'
    assert copy_fraction(prompt, '{"name": "Ada", "id": 42}') == 1.0
    assert copy_fraction(prompt, "Rivers carve valleys over thousands of years.") == 0.0


def test_unknown_figures_print_unknown():
    s = RunResult("speculative", "ngram", 0, finish_reason="length")
    s.metrics = RunMetrics(passes_saved=None, output_tokens=64, target_passes=None)
    html = figures_html(None, s, ComparisonFigures(), "fair", None)
    assert "unknown" in html and "None" not in html and "64 of 64" not in html
