"""engine.exact.kv_cache: the engines' cache writes each pass's keys and values in place and gives the logits that
transformers' DynamicCache gives, bit for bit, through every kind of pass and rollback the engines make."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.exact import decoder
from engine.exact.forward import forward, move_position, new_cache, rollback
from engine.exact.kv_cache import SPARE, GrowingLayer
from engine.exact.optimize import prepare_draft, prepare_target
from tests.conftest import CPU, tiny_llama
from tests.test_decoder import tiny_qwen2

MODELS = {
    "target": lambda: prepare_target(tiny_qwen2(seed=5), CPU),
    "draft": lambda: prepare_draft(tiny_llama(300, seed=6), CPU, int8=True),
}


def run(model, cache) -> list[torch.Tensor]:
    """An engine's passes: a prefill, steps, a verify pass and its rollback, a token tree and its accepted row
    moved, a prompt read with drafts after a cache emptied, enough steps to outgrow the first buffer, and a rollback
    followed by a pass that outgrows the buffer again."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 300, (n,), generator=g).tolist()  # noqa: E731
    out = [forward(model, ids(40), cache, keep=1), forward(model, ids(1), cache, keep=1),
           forward(model, ids(5), cache, keep=5)]
    rollback(cache, 43)
    out.append(forward(model, ids(6), cache, keep=6, tree=2, tree_at=1))
    move_position(cache, 48, 44)
    rollback(cache, 45)
    out.append(forward(model, ids(3), cache, keep=3))
    rollback(cache, 0)
    out.append(forward(model, ids(30), cache, keep=4, prompt_rows=27))
    for _ in range(SPARE // 8 + 4):
        out.append(forward(model, ids(8), cache, keep=8))
    rollback(cache, 20)
    out.append(forward(model, ids(3 * SPARE), cache, keep=3))
    return out


@pytest.mark.parametrize("plain_forward", [True, False], ids=["decoder", "the model's own forward"])
@pytest.mark.parametrize("kind", MODELS)
def test_the_same_logits_as_transformers_dynamic_cache(kind, plain_forward, monkeypatch):
    model = MODELS[kind]()
    if not plain_forward:
        monkeypatch.setattr(decoder, "runs", lambda model: False)
    ours, theirs = new_cache(model), DynamicCache(config=model.config)
    capacities = []
    update = GrowingLayer.update

    def watched(layer, *args, **kwargs):
        out = update(layer, *args, **kwargs)
        if layer is ours.layers[0] and layer.buffers[0].shape[-2] not in capacities:
            capacities.append(layer.buffers[0].shape[-2])
        return out

    monkeypatch.setattr(GrowingLayer, "update", watched)
    for i, (a, b) in enumerate(zip(run(model, ours), run(model, theirs))):
        assert torch.equal(a, b), f"pass {i} differs"
    # the first buffer (and one for the emptied cache), outgrown by steps, then by a pass after a rollback
    assert len(capacities) >= 3 and capacities[-1] == 20 + 3 * SPARE + SPARE
    assert ours.get_seq_length() == theirs.get_seq_length() == 20 + 3 * SPARE
    assert {type(layer) for layer in ours.layers} == {GrowingLayer}


def test_keys_replaced_from_outside_go_into_new_buffers():
    """transformers' own reorder, batch selection and offload give a layer new tensors: the next pass attends to
    those, not to the old buffer's rows (here the positions put in reverse order)."""
    model = MODELS["target"]()
    ours, theirs = new_cache(model), DynamicCache(config=model.config)
    for cache in (ours, theirs):
        forward(model, list(range(12)), cache, keep=1)
        with torch.inference_mode():
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.flip(-2).contiguous(), layer.values.flip(-2).contiguous()
    assert torch.equal(forward(model, [7, 8], ours, keep=2), forward(model, [7, 8], theirs, keep=2))


def test_a_sliding_window_layer_keeps_its_own_kind():
    model = tiny_qwen2(seed=7, sliding=True)
    ours, theirs = new_cache(model), DynamicCache(config=model.config)
    assert [type(x) for x in ours.layers] == [type(x) for x in theirs.layers] != [DynamicLayer] * len(ours.layers)


def test_a_pass_writes_its_rows_in_place():
    """A decoding step neither copies the cache nor allocates: the layer's keys stay views of one buffer, until a pass
    outgrows it (then the buffer grows once, with SPARE positions to spare)."""
    model = MODELS["target"]()
    cache = new_cache(model)
    forward(model, list(range(10)), cache, keep=1)
    layer = cache.layers[0]
    buffer = layer.buffers[0]
    assert buffer.shape[-2] == 10 + SPARE
    for token in range(SPARE):
        forward(model, [token], cache, keep=1)
        assert layer.buffers[0] is buffer and layer.keys.data_ptr() == buffer.data_ptr()
    assert layer.keys.shape[-2] == 10 + SPARE
    rollback(cache, 5)
    assert layer.buffers[0] is buffer and layer.keys.shape[-2] == 5
    forward(model, list(range(SPARE + 6)), cache, keep=1)  # 5 + SPARE + 6 positions: one more than the buffer holds
    assert layer.buffers[0] is not buffer and layer.buffers[0].shape[-2] == 11 + 2 * SPARE
