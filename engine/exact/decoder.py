"""A Qwen2 or Llama model's forward pass as one plain function: the operations transformers' modules run, in their
order, so the same bits (tests/test_decoder.py), without the modules' per-call machinery (hooks, keyword plumbing,
mask building, output records): the int4 target's passes and the draft's steps run 4-9 % faster
(benchmarks.step_cost). engine.exact.forward uses it where `runs(model)`, and the model's own forward elsewhere."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM, Qwen2ForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# the attention functions whose mask `run` gives as the model's forward would: the target's (engine.exact.optimize,
# which lays out its rows itself) and torch's SDPA (a draft's); others take other masks (flex: added scores)
ATTENTION = ("rowwise", "sdpa")


def runs(model) -> bool:
    """Whether `run` computes what `model`'s own forward does: a Qwen2 or Llama causal LM (not a subclass, which may
    change its forward) whose layers all attend to the whole context, with one of the ATTENTION functions."""
    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"]
    return (type(model) in (Qwen2ForCausalLM, LlamaForCausalLM) and set(layer_types) == {"full_attention"}
            and model.config._attn_implementation in ATTENTION)


def run(model, ids: torch.Tensor, cache, layout) -> torch.Tensor:
    """ids [1, T] after what `cache` holds -> the final norm's output [1, T, hidden]. `layout`
    (engine.exact.forward.PassLayout) gives the rows' positions and goes to the attention function, as the model's
    forward passes it."""
    m = model.model
    T, past = ids.shape[1], cache.get_seq_length()
    x = m.embed_tokens(ids)  # [1, T, hidden]
    positions = torch.tensor([layout.positions(past, T)], device=ids.device)
    cos, sin = m.rotary_emb(x, positions)  # [1, T, head_dim]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    attend = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    # "rowwise" lays out its rows itself; SDPA takes the model's: none for the prompt alone (causal), else a bool one
    mask = None
    if T > 1 and past:
        mask = torch.ones(T, past + T, dtype=torch.bool, device=ids.device).tril(past)[None, None]
    # .forward: a module's __call__ costs more than the small ops here
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        h = _rms_norm(layer.input_layernorm, x)
        shape = (1, T, -1, a.head_dim)
        q = a.q_proj.forward(h).view(shape).transpose(1, 2)  # [1, heads, T, head_dim]
        k = a.k_proj.forward(h).view(shape).transpose(1, 2)
        v = a.v_proj.forward(h).view(shape).transpose(1, 2)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        k, v = cache.update(k, v, i)
        out, _ = attend(a, q, k, v, mask, dropout=0.0, scaling=a.scaling, pass_layout=layout)  # [1, T, heads, D]
        x = x + a.o_proj.forward(out.reshape(1, T, -1).contiguous())
        h = _rms_norm(layer.post_attention_layernorm, x)
        mlp = layer.mlp
        x = x + mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(h)) * mlp.up_proj.forward(h))
    return _rms_norm(m.norm, x)


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
