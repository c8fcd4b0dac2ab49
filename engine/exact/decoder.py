"""A Qwen2 or Llama model's forward pass as one plain function: the operations transformers' modules run, in their
order, so the same bits (tests/test_decoder.py), without the modules' per-call machinery (hooks, keyword plumbing,
mask building, output records): the int4 target's passes and the draft's steps run 4-9 % faster
(benchmarks.step_cost). engine.exact.forward uses it where `runs(model)`, and the model's own forward elsewhere.

In passes of up to NATIVE_ROWS rows where every Linear of the model runs on the int8 kernel (engine.exact.grouped_int8:
the int4 target's steps and verify passes, its draft's steps), a layer's operations before and after its attention
run in C++ (decoder_layer.cpp): the same ATen calls, so the same bits, with no Python between them."""

from __future__ import annotations

import weakref

import torch
from transformers import LlamaForCausalLM, Qwen2ForCausalLM
from transformers.activations import SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from engine.exact.grouped_int8 import kernel

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
    native = native_layers(model) if T <= NATIVE_ROWS else None
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        q, k, v = native[i].attention_inputs(x, cos, sin) if native else _attention_inputs(layer, x, cos, sin)
        k, v = cache.update(k, v, i)
        out, _ = attend(a, q, k, v, mask, dropout=0.0, scaling=a.scaling, pass_layout=layout)  # [1, T, heads, D]
        x = native[i].output(x, out) if native else _output(layer, x, out)
    return _rms_norm(m.norm, x)


# .forward: a module's __call__ costs more than the small ops here
def _attention_inputs(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x [1, T, hidden] -> q [1, heads, T, head_dim], k and v [1, kv heads, T, head_dim]; q and k rotated."""
    a = layer.self_attn
    h = _rms_norm(layer.input_layernorm, x)
    shape = (1, x.shape[1], -1, a.head_dim)
    q = a.q_proj.forward(h).view(shape).transpose(1, 2)
    k = a.k_proj.forward(h).view(shape).transpose(1, 2)
    v = a.v_proj.forward(h).view(shape).transpose(1, 2)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin), v


def _output(layer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x and the attention's output [1, T, heads, head_dim] -> the layer's output [1, T, hidden]."""
    x = x + layer.self_attn.o_proj.forward(out.reshape(1, x.shape[1], -1).contiguous())
    h = _rms_norm(layer.post_attention_layernorm, x)
    mlp = layer.mlp
    return x + mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(h)) * mlp.up_proj.forward(h))


NATIVE_ROWS = 16  # longer passes (a prompt) run in Python: a draft's Linears change kernels there (Int4Draft)
_native: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its layers in C++, or None


def native_layers(model) -> list | None:
    """The model's layers as decoder_layer.cpp's DecoderLayer, for passes of up to NATIVE_ROWS rows, or None where
    a Linear runs on another kernel or the MLP's activation is not SiLU. Made at the model's first such pass; they
    hold the Linears' tensors and `vnni` flags as they were then: `forget` makes them again."""
    if model not in _native:
        _native[model] = _made_native(model)
    return _native[model]


def forget(model) -> None:
    """Drop `model`'s layers in C++ (made again at its next pass): after a change to its Linears."""
    _native.pop(model, None)


def _made_native(model) -> list | None:
    layers = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        operands = [linear.kernel_operands(NATIVE_ROWS) if hasattr(linear, "kernel_operands") else None
                    for linear in linears]
        if None in operands or type(mlp.act_fn) not in (SiLUActivation, torch.nn.SiLU):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(norm.weight.dtype != torch.float32 for norm in norms):
            return None
        layers.append(kernel().DecoderLayer(norms[0].weight, norms[0].variance_epsilon, norms[1].weight,
                                            norms[1].variance_epsilon, operands, a.head_dim))
    return layers


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
