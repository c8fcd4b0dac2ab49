"""benchmarks.draft_form's candidates: an int4 draft, a draft on the int8 target's kernel (measured, not kept:
docs/memory.md). Approximate by design, so
these check that it is close to the layer it replaces and which layer gets which form; how it drafts for the real
target is the benchmark's question."""

import torch
from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

from benchmarks.draft_form import GROUP, GroupedLinear, Int4Linear, candidate_draft
from tests.conftest import tiny_llama


def test_int4_layer_is_close_to_the_float_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96)
    x = torch.randn(2, 5, 256)
    y, exact = Int4Linear(linear)(x), linear(x)
    assert y.shape == exact.shape == (2, 5, 96) and y.dtype == torch.float32
    error = (y - exact).norm() / exact.norm()
    assert 0 < error < 0.08  # 16 steps per group of 32 and bfloat16 activations: a few per cent, never exact


def test_weights_on_a_group_grid_come_back_to_bfloat16_precision():
    """A GGUF 4-bit block is 16 evenly spaced values per group of 32: such weights are kept up to the bfloat16
    rounding of their scale and offset."""
    torch.manual_seed(1)
    N, K = 32, 4 * GROUP
    steps = torch.randint(0, 16, (N, K)).float()
    steps[:, ::GROUP], steps[:, 1::GROUP] = 0, 15  # each group spans all 16 steps
    scale = torch.rand(N, K // GROUP).repeat_interleave(GROUP, 1) * 0.1 + 0.01
    linear = torch.nn.Linear(K, N, bias=False)
    linear.weight.data = steps * scale - 0.5
    x = torch.randn(3, K).to(torch.bfloat16).float()
    y, exact = Int4Linear(linear)(x), linear(x)
    assert (y - exact).norm() / exact.norm() < 0.01


def test_wide_passes_run_on_the_int8_copy():
    torch.manual_seed(2)
    layer = Int4Linear(torch.nn.Linear(64, 32), max_rows=8)
    x = torch.randn(1, 9, 64)
    assert torch.equal(layer(x), layer.wide(x))
    assert not torch.equal(layer(x[:, :8]), layer.wide(x[:, :8]))


def test_the_layers_become_int4_and_the_output_layer_int8():
    model = candidate_draft(tiny_llama(512, seed=3), Int4Linear, max_rows=None)
    assert isinstance(model.lm_head, Int8Linear)  # FR-Spec prunes its rows
    layer = model.model.layers[0]
    linears = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
               layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    assert all(isinstance(linear, Int4Linear) for linear in linears)
    assert not [m for m in model.modules() if type(m) is torch.nn.Linear]


def test_grouped_draft_layers_are_close_and_wide_passes_use_the_copy():
    from engine.exact.grouped_int8 import GroupedInt8Linear, unavailable

    if unavailable():
        import pytest

        pytest.skip(unavailable())
    torch.manual_seed(4)
    linear = torch.nn.Linear(256, 96)
    layer = GroupedLinear(linear, max_rows=8)
    x = torch.randn(1, 9, 256)
    assert torch.equal(layer(x), layer.wide(x))
    y, exact = layer(x[:, :8]), linear(x[:, :8])
    assert torch.equal(y, layer.grouped(x[:, :8]))
    assert 0 < (y - exact).norm() / exact.norm() < 0.02
    model = candidate_draft(tiny_llama(512, seed=3), GroupedLinear, max_rows=None)
    assert isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.model.layers[0].mlp.down_proj.grouped, GroupedInt8Linear)
