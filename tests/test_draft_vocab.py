"""FR-Spec: the draft model's output layer pruned to its most frequent tokens (engine.exact.vocab). The ranking, the
pruned layer's logits, and greedy output identical to the baseline however few tokens the draft keeps."""

from pathlib import Path

import numpy as np
import pytest
import torch

import engine.exact.vocab
from engine.exact.proposers import DraftModelProposer, HybridProposer, NgramProposer
from engine.events import TokenKind
from engine.exact.forward import forward, new_cache
from engine.exact.decode import generate_speculative
from engine.exact.optimize import prepare_draft
from engine.exact.policy import PolicyConfig, SpecPolicy
from engine.drafting import Drafting
from engine.request import Request
from engine.limits import SettingsError
from engine.stops import StopConditions
from engine.exact.vocab import kept_ids, prune_head, rank_tokens, token_ranking
from tests.conftest import CPU, tiny_llama
from tests.test_greedy_exact import GREEDY, PROMPT, baseline, last

SMALL_CORPUS = ["def f(x):\n    return x + 1\n", "The quick brown fox.\n", "for i in range(10):\n    print(i)\n"]


def random_kept(n: int, width: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.randperm(width, generator=torch.Generator().manual_seed(seed))[:n].sort().values


@pytest.fixture
def small_corpus(tmp_path, monkeypatch):
    """Rankings built from a few lines into an empty cache: quick, and the user's cache is left alone."""
    monkeypatch.setenv("SPECCONSOLE_CACHE", str(tmp_path))
    monkeypatch.setattr(engine.exact.vocab, "corpus", lambda: SMALL_CORPUS)


def test_ranking_keeps_special_tokens_first_then_counts(smol_tokenizer):
    ranking = rank_tokens(smol_tokenizer, SMALL_CORPUS)
    assert sorted(ranking.tolist()) == list(range(len(smol_tokenizer)))  # every id, once
    first = engine.exact.vocab.always_kept(smol_tokenizer)
    assert set(ranking[: len(first)].tolist()) == set(first)
    assert {smol_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")} <= set(first)
    seen = [t for text in SMALL_CORPUS for t in smol_tokenizer(text)["input_ids"]]
    counts = np.bincount(seen, minlength=len(smol_tokenizer))
    rest = [i for i in ranking.tolist() if i not in set(first)]
    assert counts[rest[0]] == counts.max() and all(np.diff(counts[rest]) <= 0)
    ids = kept_ids(ranking, 100, width=512)
    assert len(ids) == 100 and ids.max() < 512 and torch.equal(ids, ids.sort().values)


def test_the_corpus_starts_with_our_readme_and_docs():
    """The ranking's corpus reads README.md and docs/ first (their Markdown fences matter); a wrong path would skip
    them without a word (it did once, after engine/ was split into subpackages)."""
    from engine.exact.vocab import corpus

    texts = corpus(limit=1)
    root = Path(__file__).resolve().parent.parent
    assert texts[0] == (root / "README.md").read_text(encoding="utf-8")
    assert len(texts) >= 1 + len(list((root / "docs").glob("*.md")))


def test_ranking_is_built_once_and_cached(smol_tokenizer, small_corpus, tmp_path, monkeypatch):
    first = token_ranking(smol_tokenizer)
    assert len(list((tmp_path / "vocab").glob("ranking-49152-*.npy"))) == 1
    rank = engine.exact.vocab.rank_tokens
    monkeypatch.setattr(engine.exact.vocab, "rank_tokens", lambda *a: pytest.fail("ranked again"))
    assert np.array_equal(token_ranking(smol_tokenizer), first)
    monkeypatch.setattr(engine.exact.vocab, "rank_tokens", rank)
    monkeypatch.setattr(engine.exact.vocab, "corpus", lambda: SMALL_CORPUS[:1])  # another corpus: ranked anew
    token_ranking(smol_tokenizer)
    assert len(list((tmp_path / "vocab").glob("ranking-49152-*.npy"))) == 2


@pytest.mark.parametrize("int8", [False, True])
def test_pruned_logits_are_the_full_heads_at_the_kept_ids(int8):
    model = prepare_draft(tiny_llama(512, seed=5), CPU, int8=int8)
    ids = random_kept(200)
    head = prune_head(model.get_output_embeddings(), ids)
    full = forward(model, PROMPT, new_cache(model), keep=3)  # [3, 512]
    pruned = forward(model, PROMPT, new_cache(model), keep=3, head=head)  # [3, 200]
    assert pruned.shape == (3, 200)
    if int8:  # the same int8 rows with the same scale: bitwise
        assert torch.equal(pruned, full[:, ids])
    else:  # a narrower float matmul may sum in another order
        torch.testing.assert_close(pruned, full[:, ids], rtol=0, atol=1e-5)


def test_an_unprunable_output_layer_is_refused():
    with pytest.raises(SettingsError, match="cannot prune the draft's output layer, a Identity"):
        prune_head(torch.nn.Identity(), random_kept(10))


@pytest.mark.parametrize("n", [24, 128, 400])
@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_greedy_output_identical_with_a_pruned_head(tiny_pair, smol_tokenizer, n, method):
    """However few tokens the draft keeps, the target decides: the output is the baseline's. With 24 of 512 kept
    the draft is rarely right, and it never proposes a token outside the kept set."""
    target, draft = tiny_pair
    stops = StopConditions(60)
    b = baseline(target, smol_tokenizer, PROMPT, stops)
    ids = random_kept(n)
    proposer = DraftModelProposer(draft, target.config.vocab_size, GREEDY, None, head=prune_head(draft.lm_head, ids))
    if method == "hybrid":
        proposer = HybridProposer(proposer, NgramProposer(1, 4))
    policy = SpecPolicy(PolicyConfig(k=4, dynamic=True, k_max=12), target_step_ms=1000.0)
    s = last(generate_speculative(target, smol_tokenizer, proposer, PROMPT, GREEDY, stops, policy))
    assert s.output_ids == b.output_ids
    model_drafts = {t.token_id for t in s.tokens if t.kind in (TokenKind.ACCEPTED, TokenKind.REJECTED)
                    and s.steps[t.step].drafter == "draft"}
    assert model_drafts and model_drafts <= set(ids.tolist())
    if n == 24:
        assert s.metrics.acceptance_rate < 0.5


def test_the_backend_builds_each_pruned_head_once(backend, small_corpus):
    """Drafting.draft_vocab drives the local backend: output identical, one pruned head per N, the target untouched."""
    head_before = backend.target.model.lm_head
    for method in ("draft", "hybrid"):
        req = Request(prompt="Say hello.", max_new_tokens=24, drafting=Drafting(method=method, k=4, draft_vocab=2048))
        *_, b = backend.baseline(req)
        *_, s = backend.speculative(req)
        assert s.error is None and s.output_ids == b.output_ids
    assert list(backend.heads) == [2048] and len(backend.heads[2048].ids) == 2048
    assert backend.target.model.lm_head is head_before
    assert backend.draft_head(0) is None and backend.draft_head(backend.draft.vocab_size) is None


def test_draft_vocabulary_settings_are_checked(backend):
    with pytest.raises(SettingsError, match=r"draft vocabulary \(FR-Spec\) must be 0 \(the full vocabulary\) or at "
                                            r"least 1024 tokens, got 100"):
        Request(prompt="x", drafting=Drafting(draft_vocab=100)).validate()
    with pytest.raises(SettingsError, match="got -1"):
        Request(prompt="x", drafting=Drafting(draft_vocab=-1)).validate()
    Request(prompt="x", drafting=Drafting(draft_vocab=1024)).validate()
    with pytest.raises(SettingsError, match=r"between 1024 and the draft's 49152 tokens, got 50000"):
        backend.validate(Request(prompt="x", drafting=Drafting(draft_vocab=50000)))
    # no draft model: nothing to prune
    backend.validate(Request(prompt="x", drafting=Drafting(draft_vocab=50000, method="ngram")))
