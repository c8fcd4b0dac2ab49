"""The target's weights in fewer bytes, with each row of a pass still what a one-row pass gives it.

Why: a decoding step of the 1.5B target on our 2-core CPU reads all its float32 weights (6 GB) once, so it is
bound by memory bandwidth. "float16" keeps the weights as float16 and runs fbgemm's fp16 GEMM (the kernel of torch's
dynamic float16 Linear): it widens the weights to float32 as it reads them, takes float32 activations and sums in
float32, each output row from its own input row in one order whatever the number of rows. So, like the float32
PackedLinear, every pass size gives each row the same bits (tests/test_precision.py: 1 to 300 rows), greedy
speculative output equals the baseline's, and no padding is needed. The weights are the float32 ones rounded to
float16 (relative error at most 2^-11), so the text may part from a float32 target's after some tokens.

"int8" (engine.exact.grouped_int8) goes further with a kernel of our own: weight codes 0..120 in groups of 32 and
activations quantized per row and group, like llama.cpp. torch's own weight-only int8
(aten._weight_int8pack_mm) does not pay: vectorized on x86 only for bfloat16 and float16 activations, a scalar loop
for float32 ones (`python -m benchmarks.target_precision`), and not per-row exact with per-batch activation scales.
"""

from __future__ import annotations

import torch
from torch import nn

PRECISIONS = ("float32", "float16", "int8")  # float32: engine.exact.optimize.PackedLinear, the reference


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
    if precision == "int8":
        from engine.exact.grouped_int8 import unavailable

        why = "it runs on CPU only" if device.type != "cpu" else unavailable()
        if why:
            raise ValueError(f"the int8 target precision cannot run here: {why}; use float32 or float16")


class HalfLinear(nn.Module):
    """nn.Linear with float16 weights packed for fbgemm; float32 in, float32 out."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)
        # the packed weight is opaque to torch: its size for engine.loading.models' memory figures
        self.nbytes = 2 * self.in_features * self.out_features + (0 if bias is None else 4 * self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
