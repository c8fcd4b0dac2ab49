"""FR-Spec (Zhao et al., 2025): the draft model's output layer restricted to the N most frequent tokens.

The draft's output layer (151,936 rows for the Qwen tokenizer) is a large share of each draft step, and most of
its rows are tokens a draft hardly ever proposes. Greedy drafts become the argmax over the kept rows; sampled drafts
use the kept rows' distribution as q (zero elsewhere). The target still verifies every draft, so output stays
exact; only tokens outside the kept set can no longer be drafted.

Frequencies come from text we ship or every machine has: this project's README and docs/ (English prose and Markdown,
as chat answers are written) and the Python standard library's own source (code, comments and English docstrings),
read in a fixed order up to CORPUS_CHARS, tokenized with the draft's tokenizer. Never the evaluation prompts
(HumanEval, MT-Bench). Tokens the corpus never uses follow in id order, which for a BPE tokenizer is its merge
order: roughly their frequency in the tokenizer's own training text. The ranking is cached per tokenizer and
corpus under cache_dir()/vocab.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.exact.grouped_int8 import GroupedInt4Linear, GroupedInt8Linear
from engine.exact.optimize import int8_linear
from engine.limits import SettingsError
from engine.cache import cache_dir

log = logging.getLogger(__name__)

CORPUS_CHARS = 12_000_000  # about 5 s of tokenizing on 2 cores for the Qwen tokenizer
RANKING_VERSION = 2  # bump when the corpus or the ranking rule changes: older cached rankings are then ignored


def corpus(limit: int = CORPUS_CHARS) -> list[str]:
    """The README and docs/, then the standard library's .py files in path order, up to `limit` characters. The
    standard library's tests and site-packages are left out: the first is repetitive, the second differs between
    machines.
    (The source alone lacks Markdown: without the README a code answer's ``` fence fell outside 32768 tokens.)"""
    project = Path(__file__).resolve().parents[2]  # engine/exact/vocab.py
    pages = [project / "README.md", *sorted((project / "docs").glob("*.md"))]
    texts = [page.read_text(encoding="utf-8") for page in pages if page.exists()]
    size = sum(map(len, texts))
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "idle_test"}
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        text = path.read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        size += len(text)
        if size >= limit:
            break
    return texts


def always_kept(tokenizer) -> list[int]:
    """Ids every pruned head keeps: the added/special tokens and those of the chat template's framing."""
    ids = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    if getattr(tokenizer, "chat_template", None):
        ids |= set(tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True,
                                                 add_generation_prompt=True, return_dict=False))
    return sorted(ids)


def rank_tokens(tokenizer, texts: list[str]) -> np.ndarray:
    """Every token id of the tokenizer, most useful first: the always-kept ids, then by frequency in `texts`
    (ties and unseen ids in id order)."""
    size = len(tokenizer)
    counts = np.zeros(size, dtype=np.int64)
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=size)[:size]
    first = always_kept(tokenizer)
    counts[first] = np.iinfo(np.int64).max  # ahead of any frequency
    return np.argsort(-counts, kind="stable").astype(np.int32)


def _key(tokenizer, texts: list[str]) -> str:
    """Tokenizer and corpus: a ranking is reused only for the same vocabulary counted over the same text (an
    edited README or another Python's standard library ranks anew, so a ranking always matches its corpus)."""
    vocab = hashlib.sha1(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:12]
    text = hashlib.sha1("\0".join(texts).encode()).hexdigest()[:12]
    return f"{len(tokenizer)}-{vocab}-{text}-v{RANKING_VERSION}"


def token_ranking(tokenizer) -> np.ndarray:
    """rank_tokens over corpus(), built once per tokenizer and corpus and cached (a few seconds the first time)."""
    texts = corpus()
    path = cache_dir() / "vocab" / f"ranking-{_key(tokenizer, texts)}.npy"
    if path.exists():
        return np.load(path)
    log.info("FR-Spec: ranking %d tokens by their frequency in the README and the Python standard library (once, "
             "a few seconds)", len(tokenizer))
    t = time.perf_counter()
    ranking = rank_tokens(tokenizer, texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.npy")
    np.save(partial, ranking)
    partial.replace(path)  # never a half-written ranking, even if two processes build it at once
    log.info("FR-Spec: ranking built in %.1f s, cached at %s", time.perf_counter() - t, path)
    return ranking


def kept_ids(ranking: np.ndarray, n: int, width: int) -> torch.Tensor:
    """The first n ranked ids that the draft's output layer has (ids below `width`), ascending: in id order an
    argmax over the kept rows breaks ties as the full head's argmax does."""
    ranked = ranking[ranking < width][:n]
    return torch.from_numpy(np.sort(ranked).astype(np.int64))


@dataclass(frozen=True)
class PrunedHead:
    """The draft's output layer for the kept ids only: hidden [T, H] -> logits [T, N], the same numbers the full
    layer gives in those rows."""

    ids: torch.Tensor  # [N] the kept token ids, ascending
    layer: nn.Module

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden)


def prune_head(head: nn.Module, ids: torch.Tensor) -> PrunedHead:
    """The rows `ids` of an output layer: a float Linear (tiny models, GPU), the int4 kernel's (the draft beside an
    int4 target) or an int8 dynamic-quantized one (beside an int8 target), whose kept rows keep their codes and
    scales, so the subset logits are bitwise the full ones (the kernel computes each output row on its own)."""
    quantized = torch.ao.nn.quantized.dynamic.Linear
    if type(head) in (GroupedInt8Linear, GroupedInt4Linear):
        code, scale, low = head.unblocked()
        shape = nn.Linear(head.in_features, len(ids), bias=False, device="meta")
        layer = type(head)(shape, groups=(code[ids], scale[ids], low[ids]))
        layer.bias = None if head.bias is None else head.bias[ids].contiguous()
    elif isinstance(head, quantized):
        weight, bias = head.weight(), head.bias()
        if weight.qscheme() != torch.per_tensor_affine:
            raise SettingsError(f"FR-Spec prunes per-tensor int8 output layers, not {weight.qscheme()}")
        layer = int8_linear(weight[ids], None if bias is None else bias[ids])
    elif isinstance(head, nn.Linear):
        ids = ids.to(head.weight.device)
        layer = nn.Linear(head.in_features, len(ids), bias=head.bias is not None, device=head.weight.device,
                          dtype=head.weight.dtype)
        layer.weight = nn.Parameter(head.weight[ids].detach().clone(), requires_grad=False)
        if head.bias is not None:
            layer.bias = nn.Parameter(head.bias[ids].detach().clone(), requires_grad=False)
    else:
        raise SettingsError(f"FR-Spec cannot prune the draft's output layer, a {type(head).__name__}: use draft "
                            "vocabulary 0 (full)")
    return PrunedHead(ids, layer.eval())
