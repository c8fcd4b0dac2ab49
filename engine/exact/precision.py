"""The target's weights in fewer bytes, with each row of a pass still what a one-row pass gives it.

Why: a decoding step of the 1.5B target on our 2-core CPU reads all its float32 weights (6 GB) once, so it is
bound by memory bandwidth. "float16" keeps the weights as float16 and runs fbgemm's fp16 GEMM (the kernel of torch's
dynamic float16 Linear): it widens the weights to float32 as it reads them, takes float32 activations and sums in
float32, each output row from its own input row in one order. Not whatever the number of rows, on every CPU: on an
AVX2 CPU without AVX-512 (AMD Zen 3) fbgemm computes the last 1 or 2 rows of a block of 6 with another kernel, whose
bits differ. HalfLinear pads each pass to the row multiple that a probe at first use finds exact on this CPU (1 on
AVX-512, 6 on AVX2: `row_multiple`). So, like the float32 PackedLinear, every pass size gives each row the same bits
(tests/test_precision.py: 1 to 300 rows), and greedy speculative output equals the baseline's. The weights are the
float32 ones rounded to float16 (relative error at most 2^-11), so the text may part from a float32 target's after
some tokens.

"int8" (engine.exact.grouped_int8) goes further with a kernel of our own: weight codes 0..120 in groups of 32 and
activations quantized per row and group, like llama.cpp. "int4" runs the same kernel on a GGUF's 4-bit tensors
(Q4_K, Q4_1) in their own codes (exactly the file's weights, 0.75 bytes a weight; a Q4_K tensor's 0.58, its scales
in the file's form), its Q6_K tensors in their own 6-bit codes and scales (0.82 bytes a weight), and any other
tensor in int8 codes. torch's own weight-only int8 (aten._weight_int8pack_mm)
does not pay: vectorized on x86 only for bfloat16 and float16 activations, a scalar loop for float32 ones (`python -m
benchmarks.target_precision`), and not per-row exact with per-batch activation scales.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

PRECISIONS = ("float32", "float16", "int8", "int4")  # float32: engine.exact.optimize.PackedLinear, the reference
# The console's default: int4 where its kernel runs (the fastest form and the smallest, README: the target's
# precision), float32 elsewhere
AUTO = "auto"


def resolve_precision(precision: str, device: torch.device) -> tuple[str, str | None]:
    """`precision` with AUTO made concrete: int4 on a CPU where its kernel runs (AVX2, a C++ compiler and ninja; it
    is compiled here on first use), else float32; and why AUTO gave float32 (None when it gave int4, or when a
    precision was named)."""
    if precision != AUTO:
        return precision, None
    if device.type != "cpu":
        return "float32", f"the int4 kernel runs on CPU only, not on {device}"
    from engine.exact.grouped_int8 import kernel, unavailable

    why = unavailable()
    if why is None:
        try:
            kernel()
        except Exception as e:  # noqa: BLE001 - a compiler that fails: float32 serves, and says why
            why = f"it did not compile ({type(e).__name__}: {str(e)[:300]})"
    return ("float32", f"the int4 kernel cannot run here: {why}") if why else ("int4", None)


def fp16_available(device: torch.device) -> bool:
    # the packing runs on the process's quantized engine: x86 (the default where fbgemm is built) or fbgemm
    return device.type == "cpu" and torch.backends.quantized.engine in ("x86", "fbgemm")


def check_precision(precision: str, device: torch.device) -> None:
    """ValueError, saying why, for a precision this torch cannot run on `device`."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown target precision {precision!r}; precisions: {', '.join(PRECISIONS)}")
    if precision == "float16" and not fp16_available(device):
        raise ValueError(f"the float16 target precision runs on CPU with torch's fbgemm (x86) only, not on {device}: "
                         "use float32")
    if precision == "float16":
        row_multiple()  # ValueError where no padding makes fbgemm's rows exact on this CPU
    if precision in ("int8", "int4"):
        from engine.exact.grouped_int8 import unavailable

        why = "it runs on CPU only" if device.type != "cpu" else unavailable()
        if why:
            raise ValueError(f"the {precision} target precision cannot run here: {why}; use float32 or float16")


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [..., r, in] with copies of its last row up to `rows` rows (none where r >= rows): each row's result depends
    on it alone, so the padding changes no real row's bits and the caller drops the extra rows."""
    extra = rows - x.shape[-2]
    if extra <= 0:
        return x
    return torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], extra, x.shape[-1])], dim=-2)


ROW_MULTIPLES = (1, 6)  # fbgemm's fp16 kernels take blocks of 6 rows on AVX2 and of 14 on AVX-512


@functools.cache
def row_multiple() -> int:
    """The smallest of ROW_MULTIPLES to which padding every float16 pass gives each row the bits it has in a long pass,
    probed once on a small random layer (a few ms). ValueError where none does."""
    generator = torch.Generator().manual_seed(0)
    layer = HalfLinear(nn.Linear(64, 96), multiple=1)
    x = torch.randn(1, 90, 64, generator=generator)  # [B, rows, in]
    for multiple in ROW_MULTIPLES:
        layer.multiple = multiple
        long = layer(x)
        if all(torch.equal(layer(x[:, :rows]), long[:, :rows]) for rows in range(1, 3 * multiple + 3)):
            return multiple
    raise ValueError("fbgemm's float16 kernel gives a row different bits in passes of different sizes on this CPU, "
                     "and no padding tried helps: use float32")


class HalfLinear(nn.Module):
    """nn.Linear with float16 weights packed for fbgemm; float32 in, float32 out."""

    def __init__(self, linear: nn.Linear, multiple: int | None = None):
        """`multiple`: the row multiple each pass is padded to (default: row_multiple(), probed on this CPU)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.multiple = row_multiple() if multiple is None else multiple
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)
        # the packed weight is opaque to torch: its size for engine.exact.models' memory figures
        self.nbytes = 2 * self.in_features * self.out_features + (0 if bias is None else 4 * self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., rows, in]
        rows = x.shape[-2]
        x = pad_rows(x, rows + -rows % self.multiple)
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)[..., :rows, :]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, row_multiple={self.multiple}"
