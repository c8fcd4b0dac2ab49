"""The torch GGUF dequantizer gives bitwise gguf's values; the one-pack int8 Linear is quantize_dynamic's."""

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from engine.loading import gguf_dequant
from engine.loading.gguf_load import tensor_index
from engine.exact.optimize import quantize_linear
from engine.loading.weights import gguf_model

# where each block type keeps its float16 scales (byte offsets): random bytes there could be NaN or inf
F16_FIELDS = {3: (0, 2), 6: (0,), 8: (0,), 12: (0, 2), 14: (208,)}


def random_blocks(qtype: int, n_rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    values, size, _ = gguf_dequant.KERNELS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_rows * blocks_per_row, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        raw[:, at : at + 2] = rng.normal(0, 0.05, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n_rows, blocks_per_row * size)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", sorted(gguf_dequant.KERNELS))
def test_each_block_type_matches_gguf_bitwise(qtype, monkeypatch):
    monkeypatch.setattr(gguf_dequant, "CHUNK_BLOCKS", 7)  # several chunks, the last one short
    raw = random_blocks(qtype, n_rows=5, blocks_per_row=3, seed=qtype)
    ours = gguf_dequant.dequantize(raw, qtype)
    assert same_bits(ours, gguf.dequantize(raw, qtype))
    assert ours.shape == (5, 3 * gguf_dequant.KERNELS[qtype][0])
    raw[0, 0] ^= 0xFF  # and the comparison can fail: a changed scale changes the values
    assert not same_bits(ours, gguf.dequantize(raw, qtype))


def test_float_types_and_fallback_own_their_memory():
    f32 = np.arange(8, dtype=np.float32).view(np.uint8)
    out = gguf_dequant.dequantize(f32, 0)
    assert same_bits(out, np.arange(8, dtype=np.float32)) and not np.shares_memory(out, f32)
    f16 = np.linspace(-2, 2, 8).astype(np.float16).view(np.uint8)
    assert same_bits(gguf_dequant.dequantize(f16, 1), gguf.dequantize(f16, 1))
    q5_1 = gguf.GGMLQuantizationType.Q5_1  # a type without a torch kernel: gguf's own code
    raw = np.random.default_rng(0).integers(0, 256, size=(2, 24), dtype=np.uint8)
    raw[:, :4] = np.array([0.01, 0.02], dtype=np.float16).view(np.uint8)  # d and m of its one block
    assert same_bits(gguf_dequant.dequantize(raw, q5_1), gguf.dequantize(raw, q5_1))


def test_real_gguf_tensors_match_gguf_bitwise():
    """Every tensor of the SmolLM2 GGUF the suite ships with (Q4_1, Q8_0, F32)."""
    path, meta = gguf_model("smollm2-135m-instruct")
    file = np.memmap(path, dtype=np.uint8, mode="r")
    seen = set()
    for entry in tensor_index(path, meta)["tensors"]:
        raw = file[entry["offset"] : entry["offset"] + entry["nbytes"]].view(np.dtype(entry["dtype"]))
        raw = raw.reshape(entry["shape"])
        assert same_bits(gguf_dequant.dequantize(raw, entry["type"]), gguf.dequantize(raw, entry["type"])), entry["name"]
        seen.add(entry["type"])
    assert {0, 3, 8} <= seen


@pytest.mark.parametrize("bias", [True, False])
def test_quantize_linear_is_quantize_dynamic(bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    ours = quantize_linear(linear)
    theirs = torch.ao.quantization.quantize_dynamic(nn.Sequential(linear), {nn.Linear}, dtype=torch.qint8)[0]
    assert type(ours) is type(theirs) and (ours.in_features, ours.out_features) == (64, 48)
    w, w_ref = ours.weight(), theirs.weight()
    assert torch.equal(w.int_repr(), w_ref.int_repr()) and w.q_scale() == w_ref.q_scale()
    assert (ours.bias() is None) == (not bias) and ours.has_bias == bias
    x = torch.randn(3, 64)
    assert torch.equal(ours(x), theirs(x))
