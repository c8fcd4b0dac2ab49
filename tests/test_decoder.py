"""engine.exact.decoder: the plain-function forward computes the bits of the model's own forward, for every kind of
pass the engines make (a prefill, a decoding step, a verify pass, the prompt read with drafts, a token tree, a
pruned head), on the target's exact Linears and on a draft's."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from engine.exact import decoder
from engine.exact.forward import PassLayout, forward, new_cache
from engine.exact.grouped_int8 import unavailable
from engine.exact.optimize import convert_linears, finish, linear_converter, prepare_draft, prepare_target
from engine.exact.vocab import prune_head
from tests.conftest import CPU, tiny_llama


def tiny_qwen2(seed: int, sliding: bool = False) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.3, tie_word_embeddings=False, use_sliding_window=sliding,
                         sliding_window=8 if sliding else None, max_window_layers=0)
    return Qwen2ForCausalLM(config).eval()


def own_forward(model, ids: list[int], cache: DynamicCache, keep: int, layout: PassLayout = PassLayout(),
                head=None) -> torch.Tensor:
    """What engine.exact.forward computed before it had the decoder: the model's own forward."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        if head is not None:
            hidden = model.model(input_ids=x, cache=cache, use_cache=True).last_hidden_state
            return head(hidden[0, -keep:]).float()
        positions = torch.tensor([layout.positions(cache.get_seq_length(), len(ids))])
        out = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=keep, pass_layout=layout,
                    position_ids=positions)
        return out.logits[0, -keep:].float()


def passes(vocab: int):
    """(ids, keep, layout) of one engine's passes in order: a prefill, a step, a verify pass, a token tree."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    return [(ids(70), 1, PassLayout()), (ids(1), 1, PassLayout()), (ids(5), 5, PassLayout()),
            (ids(6), 6, PassLayout(alt_rows=2, alt_at=1))]


MODELS = {"qwen2": lambda: tiny_qwen2(seed=5), "llama": lambda: tiny_llama(300, seed=6)}


@pytest.mark.parametrize("kind", MODELS)
def test_the_target_gets_its_own_forwards_bits_in_every_pass(kind):
    target = prepare_target(MODELS[kind](), CPU)
    assert decoder.runs(target)
    ours, own = new_cache(target), new_cache(target)
    for ids, keep, layout in passes(300):
        got = forward(target, ids, ours, keep, tree=layout.alt_rows, tree_at=layout.alt_at)
        assert torch.equal(got, own_forward(target, ids, own, keep, layout)), f"a {len(ids)}-row pass differs"
        assert ours.get_seq_length() == own.get_seq_length()
    for a, b in zip(ours.layers, own.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("kind", MODELS)
def test_the_prompt_read_with_drafts_gets_its_own_forwards_bits(kind):
    target = prepare_target(MODELS[kind](), CPU)
    ids = list(range(3, 40))
    got = forward(target, ids, new_cache(target), keep=5, prompt_rows=33)
    assert torch.equal(got, own_forward(target, ids, new_cache(target), 5, PassLayout(prompt_rows=33)))


@pytest.mark.parametrize("kind", MODELS)
def test_a_draft_gets_its_own_forwards_bits_with_and_without_a_pruned_head(kind):
    draft = prepare_draft(MODELS[kind](), CPU, int8=True)
    assert decoder.runs(draft) and draft.config._attn_implementation != "rowwise"
    head = prune_head(draft.lm_head, torch.arange(0, 300, 3))
    for h in (None, head):
        ours, own = new_cache(draft), new_cache(draft)
        for ids, keep, _ in passes(300)[:3]:
            assert torch.equal(forward(draft, ids, ours, keep, head=h), own_forward(draft, ids, own, keep, head=h))


def test_a_model_the_decoder_does_not_reproduce_runs_its_own_forward():
    model = prepare_target(tiny_qwen2(seed=7, sliding=True), CPU)  # sliding-window layers: the decoder has no window
    assert not decoder.runs(model)
    calls = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        logits = forward(model, list(range(3, 30)), new_cache(model), keep=2)
    finally:
        hook.remove()
    assert calls == [1] and logits.shape == (2, 300)


def int4_draft(model):
    """A draft as it runs beside the int4 target: Int4Draft Linears (the kernel for up to 16 rows, torch's int8
    above)."""
    convert_linears(model, linear_converter("draft", CPU, int8=True, precision="int4"))
    return finish(model, "draft")


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("role", ["target", "draft"])
def test_layers_in_cpp_give_the_own_forwards_bits(kind, role):
    """On the int8 kernel's Linears (the int4 target; the draft's passes of up to 16 rows) a layer's operations run in
    C++ (decoder_layer.cpp): every pass the engines make, a prompt (in Python) and the passes after it, bit for bit."""
    if unavailable():
        pytest.skip(unavailable())
    model = MODELS[kind]()
    model = prepare_target(model, CPU, precision="int4") if role == "target" else int4_draft(model)
    native = decoder.native_layers(model)
    assert decoder.runs(model) and native is not None and len(native) == model.config.num_hidden_layers
    ours, own = new_cache(model), new_cache(model)
    layouts = passes(300) if role == "target" else passes(300)[:3]
    for ids, keep, layout in layouts + [(list(range(7, 23)), 16, PassLayout())]:
        got = forward(model, ids, ours, keep, tree=layout.alt_rows, tree_at=layout.alt_at)
        assert torch.equal(got, own_forward(model, ids, own, keep, layout)), f"a {len(ids)}-row pass differs"
    for a, b in zip(ours.layers, own.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_layers_stay_in_python_where_a_linear_is_not_the_kernels():
    assert decoder.native_layers(prepare_target(tiny_qwen2(seed=5), CPU)) is None  # float32: PackedLinear
    assert decoder.native_layers(prepare_draft(tiny_qwen2(seed=5), CPU, int8=True)) is None  # torch's int8
