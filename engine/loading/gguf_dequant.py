"""GGUF block dequantization in torch: the same float32 values as gguf's numpy code, several times faster.

Why: gguf's numpy dequantization is single-threaded and makes a dozen full-size temporaries per tensor; it took
~15 s of every start for the 1.5B target. These functions do the same integer unpacking and the same float32
operations in the same order (d * scale, then * q, then - dmin * min), so every value is bitwise what gguf gives
(tests/test_gguf_dequant.py checks each type against gguf), on torch's threads, a chunk of blocks at a time so that
the temporaries stay small. Block layouts are ggml's (ggml-common.h); types we do not ship fall back to gguf.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

QK_K = 256  # values per k-quant super-block
CHUNK_BLOCKS = 1 << 14  # blocks dequantized at a time: bounds the temporaries to a few MB


def _f16(b: torch.Tensor) -> torch.Tensor:  # [n, 2] uint8 -> [n, 1] float32
    return b.contiguous().view(torch.float16).float()


def _shifts(*s: int) -> torch.Tensor:
    return torch.tensor(s, dtype=torch.uint8)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # d f16 | 32 x int8
    d, x = _f16(b[:, :2]), b[:, 2:].contiguous().view(torch.int8).float()
    return x * d


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # d f16 | m f16 | 16 bytes of 4-bit q (low nibbles first)
    n = b.shape[0]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    qs = (b[:, 4:].reshape(n, 1, 16) >> _shifts(0, 4).reshape(1, 2, 1)) & 0x0F  # [n, 2, 16]
    return (d * qs.reshape(n, 32).float()) + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # d f16 | 32 high bits (little-endian u32) | 16 bytes of low nibbles
    n = b.shape[0]
    d = _f16(b[:, :2])
    qh = (b[:, 2:6].reshape(n, 4, 1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [n, 4, 8]: bit i of the u32
    ql = (b[:, 6:].reshape(n, 1, 16) >> _shifts(0, 4).reshape(1, 2, 1)) & 0x0F  # [n, 2, 16]
    q = (ql.reshape(n, 32) | (qh.reshape(n, 32) << 4)).view(torch.int8) - 16
    return d * q.float()


def _q4_k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    n = s.shape[0]
    s = s.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn  # [n, 8] each


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # d f16 | dmin f16 | 12 bytes scales | 128 bytes of 4-bit q
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _q4_k_scales(b[:, 4:16])
    d = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    qs = (b[:, 16:].reshape(n, 4, 1, 32) >> _shifts(0, 4).reshape(1, 1, 2, 1)) & 0x0F  # [n, 4, 2, 32]
    return (d * qs.reshape(n, 8, 32).float() - dm).reshape(n, QK_K)


def four_bit_groups(raw: np.ndarray, qtype: int) -> tuple[torch.Tensor, ...] | None:
    """A Q4_K or Q4_1 tensor's bytes [N, bytes per row] as its own groups of 32 (for
    engine.exact.grouped_int8.GroupedInt4Linear): codes q [N, K] uint8 in 0..15, and scale, low [N, K / 32] float32
    with w = scale * q + low; None for other types. In float32, scale * q + low is bitwise what _q4_k (d * q - dm:
    adding -dm is subtracting dm) and _q4_1 compute. A Q4_K tensor's tuple goes on with the terms of its scales
    (engine.exact.grouped_int8.GroupedQ4KLinear): d, dmin [N, K / 256] float16 and sc, m [N, K / 32] uint8, with
    scale = d.float() * sc.float() and low = -(dmin.float() * m.float()) for group g of super-block g // 8."""
    qtype = int(qtype)
    if qtype not in (3, 12):
        return None
    rows = raw.shape[0]
    b = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1, KERNELS[qtype][1]))  # [n blocks, bytes]
    n = b.shape[0]
    if qtype == 3:  # Q4_1: one group a block
        qs = (b[:, 4:].reshape(n, 1, 16) >> _shifts(0, 4).reshape(1, 2, 1)) & 0x0F  # [n, 2, 16]
        scale, low = _f16(b[:, :2]), _f16(b[:, 2:4])  # [n, 1]
        return qs.reshape(rows, -1), scale.reshape(rows, -1), low.reshape(rows, -1)
    # Q4_K: eight
    d, dmin = (b[:, i: i + 2].contiguous().view(torch.float16) for i in (0, 2))  # [n, 1]
    sc, mn = _q4_k_scales(b[:, 4:16])
    qs = (b[:, 16:].reshape(n, 4, 1, 32) >> _shifts(0, 4).reshape(1, 1, 2, 1)) & 0x0F  # [n, 4, 2, 32]
    scale, low = d.float() * sc.float(), -(dmin.float() * mn.float())  # [n, 8]
    return tuple(t.reshape(rows, -1) for t in (qs, scale, low, d, dmin, sc, mn))


class SixBitTerms(NamedTuple):
    """A Q6_K tensor's own terms (for engine.exact.grouped_int8.GroupedQ6KLinear): w = (float(d) * sc) * (q - 32)
    for the 16 weights of each scale, bitwise _q6_k's values."""

    code: torch.Tensor  # q [N, K] uint8 in 0..63
    sc: torch.Tensor  # [N, K / 16] int8
    d: torch.Tensor  # [N, K / 256] float16


def six_bit_terms(raw: np.ndarray, qtype: int) -> SixBitTerms | None:
    """A Q6_K tensor's bytes [N, bytes per row] as its SixBitTerms; None for other types."""
    if int(qtype) != 14:
        return None
    rows = raw.shape[0]
    b = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1, KERNELS[14][1]))  # [n blocks, 210]
    n = b.shape[0]
    ql = (b[:, :128].reshape(n, 2, 1, 64) >> _shifts(0, 4).reshape(1, 1, 2, 1)) & 0x0F  # [n, 2, 2, 64]
    qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 4, 1)) & 0x03  # [n, 2, 4, 32]
    code = ql.reshape(n, QK_K) | (qh.reshape(n, QK_K) << 4)
    sc = b[:, 192:208].contiguous().view(torch.int8)
    d = b[:, 208:210].contiguous().view(torch.float16)
    return SixBitTerms(code.reshape(rows, -1), sc.reshape(rows, -1), d.reshape(rows, -1))


def _q6_k(b: torch.Tensor) -> torch.Tensor:  # 128 bytes low 4 bits | 64 bytes high 2 bits | 16 int8 scales | d f16
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).reshape(n, QK_K // 16, 1)
    ql = (b[:, :128].reshape(n, 2, 1, 64) >> _shifts(0, 4).reshape(1, 1, 2, 1)) & 0x0F  # [n, 2, 2, 64]
    qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 4, 1)) & 0x03  # [n, 2, 4, 32]
    q = (ql.reshape(n, 8, 32) | (qh.reshape(n, 8, 32) << 4)).view(torch.int8) - 32
    return (d * q.reshape(n, QK_K // 16, 16).float()).reshape(n, QK_K)


# ggml type id -> (values per block, bytes per block, function of [n, bytes] uint8 -> [n, values] float32)
KERNELS = {
    3: (32, 20, _q4_1),
    6: (32, 22, _q5_0),
    8: (32, 34, _q8_0),
    12: (QK_K, 144, _q4_k),
    14: (QK_K, 210, _q6_k),
}


def dequantize(data: np.ndarray, qtype: int) -> np.ndarray:
    """What gguf.dequantize(data, qtype) returns (float32, the logical shape), computed with torch, in memory of
    its own (never a view of `data`, which may be a mapped file)."""
    qtype = int(qtype)
    if qtype == 0:  # F32
        return data.view(np.float32).copy()
    if qtype == 1:  # F16
        return torch.from_numpy(data.view(np.float16)).float().numpy()
    if qtype not in KERNELS:
        from gguf import dequantize as gguf_dequantize

        return np.array(gguf_dequantize(data, qtype), copy=True)
    values, size, kernel = KERNELS[qtype]
    raw = data.view(np.uint8)
    shape = (*raw.shape[:-1], raw.shape[-1] // size * values)
    blocks = torch.from_numpy(raw.reshape(-1, size))  # a view of the (read-only) mapped file: never written
    out = torch.empty(blocks.shape[0], values, dtype=torch.float32)
    with torch.inference_mode():
        for i in range(0, blocks.shape[0], CHUNK_BLOCKS):
            out[i : i + CHUNK_BLOCKS] = kernel(blocks[i : i + CHUNK_BLOCKS])
    return out.numpy().reshape(shape)
