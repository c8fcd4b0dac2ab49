"""CPU speed-ups that keep the target exact, and the (approximate) int8 draft.

Why the target needs care: greedy speculative decoding equals plain decoding only if the target's logits for a
position are the same whether it scores 1 token (baseline step) or K+1 tokens (verify pass). Two kernels break
that bitwise on this CPU: dense float32 matmul (its reduction order depends on the number of rows) and fused
attention over several queries. We replace them with:

- `PackedLinear`: oneDNN weights prepacked once (`mkldnn._reorder_linear_weight`). Measured here: rows agree
  bitwise for any number of rows >= 2, and a 5-token verify costs far less than with dense weights. A single
  row takes another kernel on large layers (not bitwise), and 1-4 rows are slower than 5 on our 2-core CPU, so a
  pass over fewer than `min_rows` (5) rows runs padded to 5: exact, and faster for every engine that uses the
  target (the baseline, ours and HF assisted generation alike).
  With precision "float16" the Linears are engine.exact.precision's `HalfLinear` instead: half the bytes, each row
  exact for any number of rows, no padding; with "int8", engine.exact.grouped_int8's `GroupedInt8Linear` (a
  third of float32's bytes, llama.cpp's kind of arithmetic, each row exact, no padding).
- `rowwise_attention`: each query of a short pass attends with its own single-query SDPA call, exactly the
  call the baseline makes at that position. Long passes (the prompt) use one fused causal call; both engines
  prefill the same prompt with the same call, so their caches agree.

With both, a verify pass is bitwise identical to the same positions decoded one by one (with min_rows = 1 large
layers may differ in the last bits; the console shows the first divergence if that ever flips a token).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.exact import tree
from engine.exact.forward import PassLayout
from engine.exact.grouped_int8 import GROUP, GroupedInt4Linear, GroupedInt8Linear, unavailable
from engine.exact.precision import HalfLinear, check_precision, pad_rows

log = logging.getLogger(__name__)

ROWWISE_MAX_QUERIES = 64  # above this a pass is a prefill: one fused causal attention call
# Fewer rows than this run padded to it (`python -m benchmarks.pass_cost --min-rows 1` shows why: on our 2-core CPU
# one target pass over 1, 2 or 3 tokens took 304, 348 and 281 ms unpadded, 249, 246 and 254 ms padded to 5).
MIN_ROWS = 5


def rowwise_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      pass_layout: PassLayout | None = None, **kwargs):
    """The target's attention (config._attn_implementation "rowwise"). `pass_layout`: which rows of the pass are the
    prompt's or a token tree's, made by engine.exact.forward.forward and passed through the model; None: a plain pass."""
    # query [B, H, Q, D]; key, value [B, H_kv, T, D] with the Q new positions last; batch size 1, no padding
    layout = pass_layout or PassLayout()
    # grouped-query attention inside SDPA: no copy of the whole cache per layer and pass (repeat_interleave was 3 ms
    # of a pass at 400 positions), and the same bits as attending to the repeated heads
    gqa = query.shape[1] != key.shape[1]
    Q, T = query.shape[2], key.shape[2]
    prompt_rows, alt_rows = layout.prompt_rows, layout.alt_rows
    if prompt_rows is not None and prompt_rows < Q:
        # The prompt read together with the first drafts (T == Q): the prompt's rows take the call the baseline's
        # prefill makes, the drafts' rows the calls of the decoding steps at their positions.
        prompt = _attend(query[:, :, :prompt_rows], key[:, :, :prompt_rows], value[:, :, :prompt_rows], scaling, gqa)
        drafts = _attend(query[:, :, prompt_rows:], key, value, scaling, gqa)
        out = torch.cat([prompt, drafts], dim=2)
    elif alt_rows:
        # A token tree: the chain's rows as a plain pass's (they never see the alternatives), then the alternatives'
        chain = _attend(query[:, :, : Q - alt_rows], key[:, :, : T - alt_rows], value[:, :, : T - alt_rows], scaling,
                        gqa)
        out = torch.cat([chain, tree.attend(query, key, value, layout, scaling, gqa)], dim=2)
    else:
        out = _attend(query, key, value, scaling, gqa)
    return out.transpose(1, 2).contiguous(), None  # [B, Q, H, D]


def _attend(query, key, value, scaling, gqa: bool):
    """query [B, H, Q, D] for the last Q of the T positions in key, value [B, H_kv, T, D] -> [B, H, Q, D]."""
    Q, T = query.shape[2], key.shape[2]
    if Q > ROWWISE_MAX_QUERIES:
        causal = torch.ones(Q, T, dtype=torch.bool, device=query.device).tril(T - Q)  # new rows see the cache
        return F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=scaling, enable_gqa=gqa)
    rows = [
        F.scaled_dot_product_attention(
            query[:, :, i : i + 1], key[:, :, : T - Q + i + 1], value[:, :, : T - Q + i + 1], scale=scaling,
            enable_gqa=gqa,
        )
        for i in range(Q)
    ]
    return rows[0] if Q == 1 else torch.cat(rows, dim=2)  # a decoding step: no copy


class PackedLinear(nn.Module):
    """nn.Linear with oneDNN-prepacked float32 weights."""

    def __init__(self, linear: nn.Linear, min_rows: int = MIN_ROWS):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.min_rows = min_rows
        # the batch-size hint picks the GEMM kernel: with a hint >= 2 every row count >= 2 agrees bitwise
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 8)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, rows, in]
        rows = x.shape[-2]
        x = pad_rows(x, self.min_rows)
        y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return y[..., :rows, :]


# a draft pass of more rows than this (the prompt) runs on Int4Draft's int8 copy: torch's kernel is faster there
DRAFT_NARROW_ROWS = 16


class Int4Draft(nn.Module):
    """A draft Linear beside an int4 target: its passes of up to DRAFT_NARROW_ROWS rows (the drafting steps) on the
    int4 target's kernel (engine.exact.grouped_int8.GroupedInt4Linear: 16 levels per group of 32 from the draft's
    weights), longer ones on torch's dynamic int8 Linear, which the 4-bit kernel is slower than for many rows. The
    draft may be approximate (the target verifies every token). Measured against the all-int8 draft with an int4
    target: a draft step 26 against 35 ms, tok/s 1.06x [1.01, 1.08] (docs/memory.md)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.narrow = GroupedInt4Linear(linear)
        self.wide = quantize_linear(linear)

    @classmethod
    def shell(cls, in_features: int, out_features: int, bias: bool) -> Int4Draft:
        """An Int4Draft to be filled by load_state_dict(..., assign=True) (engine.exact.int8_store)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = in_features, out_features
        layer.narrow = GroupedInt4Linear.shell(in_features, out_features, bias)
        layer.wide = dynamic_int8_shell(in_features, out_features, bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] float32
        return self.wide(x) if x.numel() > DRAFT_NARROW_ROWS * self.in_features else self.narrow(x)

    def kernel_operands(self, rows: int) -> tuple | None:
        """The int8 kernel's operands for passes of up to `rows` rows (engine.exact.decoder), None where torch's
        int8 Linear runs some of them."""
        return self.narrow.operands() if rows <= DRAFT_NARROW_ROWS else None


def int4_draft_or_int8(linear: nn.Linear) -> nn.Module:
    """The int4 target's draft converter: Int4Draft where the kernel takes the layer's width, else int8."""
    return Int4Draft(linear) if linear.in_features % GROUP == 0 else quantize_linear(linear)


def free_rows(model: nn.Module) -> int:
    """The pass size a token tree fills up to (engine.exact.tree): rows that cost (almost) nothing more. A float32 CPU
    target pads its short passes to its PackedLinears' min_rows anyway. A float16 one (HalfLinear) pads nothing on
    AVX-512, where each row past the second costs 12-16 % of a plain step (`python -m benchmarks.pass_cost --precision
    float16`, docs/memory.md): no tree (on AVX2 it pads to 6 rows for exactness; a tree there is not measured). Nor for int8 (GroupedInt8Linear), whose extra rows cost more still. Any other (a
    GPU's): MIN_ROWS."""
    layers = [m for m in model.modules() if isinstance(m, (PackedLinear, HalfLinear, GroupedInt8Linear))]
    if any(isinstance(m, (HalfLinear, GroupedInt8Linear)) for m in layers):
        return 0
    return min((m.min_rows for m in layers), default=MIN_ROWS)


def convert_linears(model: nn.Module, convert) -> nn.Module:
    """Replace each nn.Linear of `model` by convert(linear) (see linear_converter)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, convert(child))
    return model


def prepare_target(model: nn.Module, device: torch.device, min_rows: int = MIN_ROWS,
                   precision: str = "float32") -> nn.Module:
    """Exact optimisations for the target (and for the baseline, which uses the same model object); `precision`:
    one of engine.exact.precision.PRECISIONS."""
    convert_linears(model, linear_converter("target", device, min_rows, precision=precision))
    return finish(model, "target")


def prepare_draft(model: nn.Module, device: torch.device, int8: bool) -> nn.Module:
    """The draft may be approximate: int8 dynamic quantization reads a quarter of the bytes per token."""
    convert_linears(model, linear_converter("draft", device, int8=int8))
    return finish(model, "draft")


def quantize_linear(linear: nn.Linear) -> nn.Module:
    """The module quantize_dynamic(..., {nn.Linear}, torch.qint8) swaps in for `linear` (same observer, same int8
    weights), built without first packing a blank full-size weight as torch's constructor does: that packing was a
    third of the draft's load time."""
    from torch.ao.nn.quantized.modules.utils import _quantize_weight
    from torch.ao.quantization.qconfig import default_dynamic_qconfig

    observer = default_dynamic_qconfig.weight()
    observer(linear.weight)
    qweight = _quantize_weight(linear.weight.float(), observer)
    return int8_linear(qweight, None if linear.bias is None else linear.bias.detach())


def int8_linear(qweight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A dynamic int8 Linear over a quantized weight [out, in], packed once (torch's constructor would first pack a
    blank weight of the full size)."""
    layer = dynamic_int8_shell(qweight.shape[1], qweight.shape[0], bias is not None)
    layer.set_weight_bias(qweight, bias)  # the real weight, packed once
    return layer


def dynamic_int8_shell(in_features: int, out_features: int, bias: bool) -> nn.Module:
    """A dynamic int8 Linear of that shape whose weight is still a 1x1 placeholder: set_weight_bias, or
    load_state_dict (engine.exact.int8_store), packs the real one."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    layer = DynamicLinear(1, 1, dtype=torch.qint8)
    layer.out_features, layer.in_features = out_features, in_features
    layer.has_bias = bias  # for sizes: asking the packed weight unpacks it (slow)
    return layer


def linear_converter(role: str, device: torch.device, min_rows: int = MIN_ROWS, int8: bool = False,
                     precision: str = "float32"):
    """What prepare_target / prepare_draft turn one float32 Linear into, for loaders that convert layer by layer
    (so that the float32 weights of the whole model never exist at once). `precision` is the target's
    (engine.exact.precision; a draft's form follows it: Int4Draft beside an int4 target); ValueError for one that
    cannot run on `device`."""
    cpu = device.type == "cpu"
    if role == "target":
        check_precision(precision, device)
        if precision == "float16":
            return HalfLinear
        if precision in ("int8", "int4"):  # int4: engine.loading passes Q4_K, Q4_1 and Q6_K Linears to int4_of_gguf
            return GroupedInt8Linear
    if role == "target" and cpu and torch.backends.mkldnn.is_available():
        return lambda linear: PackedLinear(linear, min_rows)
    if role == "draft" and int8 and cpu:
        # beside an int4 target the kernel is compiled anyway: the draft's steps run on it too
        return int4_draft_or_int8 if precision == "int4" and unavailable() is None else quantize_linear
    return lambda linear: linear.to(device)


def register_attention() -> None:
    """Make "rowwise" a name transformers knows, before a model's config names it (registering again replaces it)."""
    from transformers import AttentionInterface

    AttentionInterface.register("rowwise", rowwise_attention)


def finish(model: nn.Module, role: str) -> nn.Module:
    """The rest of prepare_target / prepare_draft for a model whose Linears linear_converter already converted."""
    if role == "target":
        register_attention()
        model.config._attn_implementation = "rowwise"
    head = model.get_output_embeddings()
    if isinstance(head, Int4Draft):
        # a draft reads one row of logits a pass (its prompt pass included): the output layer, a large share of a
        # 0.5B draft's bytes, always runs on the int4 kernel, and the int8 copy for long passes is not kept
        model.set_output_embeddings(head.narrow)
    return model.eval()
