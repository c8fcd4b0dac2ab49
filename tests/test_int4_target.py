"""The int4 target (engine.exact.grouped_int8.GroupedInt4Linear): the int8 kernel on a GGUF's own 4-bit codes. Each
row of a pass is what a one-row pass gives it, the 4-bit layout holds what the 8-bit one would, the codes are exactly
the file's, a Q4_K tensor's scale form (GroupedQ4KLinear) gives the float32 scales' bits, a Q6_K tensor keeps its own
codes and scales (GroupedQ6KLinear), and greedy speculative output equals the baseline's, on a tiny model and on real
weights."""

import copy
import logging

import numpy as np
import pytest
import torch
from torch import nn

from engine.exact import grouped_int8
from engine.exact.grouped_int8 import (GROUP, SUPER, GroupedInt4Linear, GroupedInt8Linear, GroupedQ4KLinear,
                                       GroupedQ6KLinear, blocked, int4_of_gguf, six_bit_values)
from engine.loading.gguf_dequant import SixBitTerms
from engine.exact.optimize import convert_linears, finish, free_rows, linear_converter, prepare_draft
from tests.conftest import CPU, perturbed, skip_or_fail, tiny_llama
from tests.test_int8_target import ROWS, VNNI, reference

# the greedy identity tests, collected here again with tiny_pair below (which ones, and why: test_int8_target)
from tests.test_greedy_exact import (  # noqa: F401
    test_draft_model_fixed_k,
    test_dynamic_k_and_fallback,
    test_eos_in_the_middle_of_a_step,
    test_first_pass_reads_prompt_and_drafts_as_the_baseline_does,
    test_max_tokens_never_overshoots,
    test_ngram,
    test_per_token_draft_stop,
    test_step_0_drafts,
    test_stop_string_in_the_middle_of_a_step,
    test_token_tree_branch_after_accepted_drafts,
)

if grouped_int8.unavailable():
    skip_or_fail(f"the int4 target cannot run here: {grouped_int8.unavailable()}", module=True)


@pytest.fixture(scope="module")
def tiny_pair():
    """conftest's tiny_pair with every Linear of the target in 4-bit codes (a tiny model has no GGUF: its weights are
    quantized to 16 levels), for test_greedy_exact's tests imported above. The draft perturbs the weights the codes
    stand for: 16 levels move this small model's choices too far from its float weights' for a draft made from those
    to be accepted."""
    weights = tiny_llama(512, seed=1)
    target = finish(convert_linears(copy.deepcopy(weights), GroupedInt4Linear), "target")
    for name, layer in target.named_modules():
        if isinstance(layer, GroupedInt4Linear):
            weights.get_submodule(name).weight.data = layer.dequantized()
    assert free_rows(target) == 0
    return target, prepare_draft(perturbed(weights, 0.3, seed=1), CPU, int8=False)  # a seed that yields every kind


@pytest.mark.parametrize("vnni", VNNI)
@pytest.mark.parametrize("shape", [(64, 96), (96, 40), (896, 4864), (8960, 1536)])  # (in, out)
def test_every_pass_size_gives_each_row_what_a_single_row_gives(shape, vnni):
    torch.manual_seed(0)
    x = torch.randn(1, 300, shape[0]) * torch.rand(1, 300, 1) * 4
    layer = GroupedInt4Linear(nn.Linear(*shape))
    layer.vnni = vnni
    assert layer.code.shape[-1] == 256 and int(layer.unblocked()[0].max()) <= 15
    long = layer(x)
    for rows in ROWS:
        assert torch.equal(layer(x[:, :rows]), long[:, :rows]), f"a {rows}-row pass differs from a 300-row pass"
    for i in range(0, 300, 23):
        assert torch.equal(layer(x[:, i: i + 1]), long[:, i: i + 1]), f"row {i} alone differs"
    if vnni:
        layer.vnni = False
        assert torch.equal(layer(x), long), "AVX2's kernel and VNNI's differ"
    assert torch.allclose(long[0].double(), reference(x, layer), rtol=1e-5, atol=1e-5 * long.abs().max().item())


@pytest.mark.parametrize("vnni", VNNI)
def test_four_bit_codes_give_the_bits_of_the_same_weights_in_eight(vnni):
    """Codes c in 4 bits with scale s compute exactly what codes 8c in the 8-bit layout with scale s/8 do (the
    integer sums are 8 times larger, the float steps the same up to a power of two): the nibbles are unpacked right."""
    torch.manual_seed(1)
    four = GroupedInt4Linear(nn.Linear(1536, 200))
    eight = GroupedInt8Linear(nn.Linear(1536, 200))
    code, scale, low = four.unblocked()
    eight.code, eight.scale, eight.low = blocked(code * 8, scale / 8, low)
    eight.bias, four.vnni, eight.vnni = four.bias, vnni, vnni
    x = torch.randn(7, 1536)
    assert torch.equal(four(x), eight(x))
    assert torch.equal(four.dequantized(), eight.dequantized())


def q4_k_groups(n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """four_bit_groups' tuple for a random Q4_K tensor [n, k]: codes, scale and low as four_bit_groups computes them
    from d, dmin (float16, some zero, some subnormal, some negative) and 6-bit sc, m (some zero)."""
    torch.manual_seed(seed)
    code = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d, dmin = (torch.randn(n, k // (GROUP * SUPER)) * 1e-3 for _ in range(2))
    for t in (d, dmin):
        t.view(-1)[::7], t.view(-1)[3::11], t.view(-1)[5::13] = 0, 3e-6, -t.view(-1)[5::13]
    d, dmin = d.half(), dmin.half()
    sc, m = (torch.randint(0, 64, (n, k // GROUP), dtype=torch.uint8) for _ in range(2))
    m.view(-1)[::5] = 0  # low = -0.0
    scale = d.float().repeat_interleave(SUPER, dim=1) * sc.float()
    low = -(dmin.float().repeat_interleave(SUPER, dim=1) * m.float())
    return code, scale, low, d, dmin, sc, m


def q4_k_pair(n: int, k: int, seed: int = 0) -> tuple[GroupedQ4KLinear, GroupedInt4Linear]:
    """One random Q4_K tensor's Linear in the scale form and in float32 scales, as int4_of_gguf builds them."""
    groups = q4_k_groups(n, k, seed)
    code, scale, low = groups[:3]
    linear = nn.Linear(k, n)
    linear.weight.data = (code.float().reshape(n, -1, GROUP) * scale[..., None] + low[..., None]).reshape(n, k)
    compact, floats = int4_of_gguf(linear, groups), int4_of_gguf(linear, groups[:3])
    assert type(compact) is GroupedQ4KLinear and type(floats) is GroupedInt4Linear
    return compact, floats


@pytest.mark.parametrize("vnni", VNNI)
@pytest.mark.parametrize("shape", [(256, 40), (512, 200), (1536, 256), (1536, 8960), (8960, 1536)])  # (in, out)
def test_the_q4_k_scale_form_gives_the_float32_scales_bits(shape, vnni):
    """The kernel's scale = float(d) * sc and low = float(-dmin) * m, computed per group as the pass runs, are the
    float32 scales' and lows' bits (a zero's sign too), so every output is: every pass size from 1 to 300 rows."""
    compact, floats = q4_k_pair(shape[1], shape[0])
    compact.vnni = floats.vnni = vnni
    assert compact.code.shape[-1] == 256 and compact.d_dmin.dtype == torch.float16
    for mine, theirs in zip(compact.unblocked(), floats.unblocked()):  # the layer's rows (not the padding's)
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    x = torch.randn(300, shape[0]) * torch.rand(300, 1) * 4
    for rows in range(1, 301) if shape[0] * shape[1] < 1 << 20 else [*ROWS, 300]:
        assert torch.equal(compact(x[:rows]), floats(x[:rows])), f"{rows} rows differ"
    if vnni:
        long = compact(x)
        compact.vnni = False
        assert torch.equal(compact(x), long), "AVX2's kernel and VNNI's differ"
    # 18.5 bytes per 32 weights against 24 (the bias aside)
    weights = shape[0] * -(-shape[1] // 16) * 16
    assert [sum(b.nbytes for n, b in m.named_buffers() if n != "bias") for m in (compact, floats)] == [
        weights * 37 // 64, weights * 3 // 4]


def q6_k_terms(n: int, k: int, seed: int) -> SixBitTerms:
    """A random Q6_K tensor [n, k]'s terms: codes 0..63 (their extremes included), int8 sc (-128 and 127 included,
    some zero), float16 d (some zero, some subnormal, some negative)."""
    torch.manual_seed(seed)
    code = torch.randint(0, 64, (n, k), dtype=torch.uint8)
    code.view(-1)[::17], code.view(-1)[5::19] = 0, 63
    sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8)
    sc.view(-1)[::9], sc.view(-1)[1::11], sc.view(-1)[2::13] = -128, 127, 0
    d = torch.randn(n, k // (GROUP * SUPER)) * 1e-3
    d.view(-1)[::7], d.view(-1)[3::11] = 0, 3e-6
    return SixBitTerms(code, sc, d.half())


def six_bit_reference(x: torch.Tensor, terms: SixBitTerms, bias: torch.Tensor) -> torch.Tensor:
    """The Q6_K form's arithmetic: activations quantized per row and group of 32 (in float32, as the kernel does),
    then the file's weights (exact in float64) times the quantized activations, in float64."""
    rows = x.reshape(x.shape[0], -1, GROUP)
    xscale = rows.abs().amax(-1) / 127
    xq = torch.round(rows * torch.where(xscale > 0, 1 / xscale, 0)[..., None]).double()
    weight = six_bit_values(terms).double().reshape(terms.code.shape[0], -1, GROUP)
    return (torch.einsum("rgk,ngk->rng", xq, weight) * xscale.double()[:, None, :]).sum(-1) + bias.double()


@pytest.mark.parametrize("vnni", VNNI)
@pytest.mark.parametrize("shape", [(256, 40), (1536, 256), (8960, 1536), (1536, 8960)])  # (in, out)
def test_the_q6_k_form_keeps_the_files_weights_and_gives_each_row_what_a_single_row_gives(shape, vnni):
    """A Q6_K tensor's Linear holds its codes and scales as the file has them (26.25 bytes per 32 weights), computes
    with exactly its weights, gives each row the bits a one-row pass gives it, and AVX2's kernel VNNI's bits."""
    terms = q6_k_terms(shape[1], shape[0], seed=3)
    linear = nn.Linear(*shape)
    linear.weight.data = six_bit_values(terms)
    layer = int4_of_gguf(linear, terms)
    assert type(layer) is GroupedQ6KLinear and layer.code.shape[-1] == 384
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(layer.unblocked(), terms))
    assert torch.equal(layer.dequantized(), linear.weight.data)
    weights = shape[0] * -(-shape[1] // 16) * 16
    assert sum(b.nbytes for n, b in layer.named_buffers() if n != "bias") == weights * 105 // 128
    x = torch.randn(300, shape[0]) * torch.rand(300, 1) * 4
    x[7] = 0  # a row of zeros: its scales are zero
    layer.vnni = vnni
    long = layer(x)
    for rows in ROWS:
        assert torch.equal(layer(x[:rows]), long[:rows]), f"a {rows}-row pass differs from a 300-row pass"
    for i in range(0, 300, 23):
        assert torch.equal(layer(x[i: i + 1]), long[i: i + 1]), f"row {i} alone differs"
    if vnni:
        layer.vnni = False
        assert torch.equal(layer(x), long), "AVX2's kernel and VNNI's differ"
    reference = six_bit_reference(x, terms, linear.bias.data)
    assert torch.allclose(long.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def test_a_q6_k_layer_is_stored_and_read_back_by_its_shell():
    """What engine.exact.int8_store does with it: the state dict loaded into GroupedQ6KLinear.shell's meta tensors
    (strictly, by assignment) computes the same bits."""
    terms = q6_k_terms(40, 512, seed=4)
    linear = nn.Linear(512, 40)
    linear.weight.data = six_bit_values(terms)
    layer = GroupedQ6KLinear(linear, terms)
    stored = GroupedQ6KLinear.shell(512, 40, bias=True)
    stored.load_state_dict(layer.state_dict(), strict=True, assign=True)
    x = torch.randn(9, 512)
    assert torch.equal(stored(x), layer(x)) and all(torch.equal(a, b) for a, b in zip(stored.unblocked(), terms))
    with pytest.raises(TypeError, match="a scale per 16 weights"):
        layer.scales()


def test_the_converter_keeps_the_files_codes_and_falls_back_to_int8(caplog):
    torch.manual_seed(2)
    linear = nn.Linear(64, 48)
    code = torch.randint(0, 16, (48, 64), dtype=torch.uint8)
    scale, low = torch.rand(48, 2) / 10, -torch.rand(48, 2)
    linear.weight.data = (code.float().reshape(48, 2, GROUP) * scale[..., None] + low[..., None]).reshape(48, 64)
    layer = int4_of_gguf(linear, (code, scale, low))
    assert isinstance(layer, GroupedInt4Linear) and torch.equal(layer.dequantized(), linear.weight.data)
    assert torch.equal(layer.unblocked()[0], code)
    assert not hasattr(linear, "gguf_q4")  # nothing glued onto the Linear
    reordered = (code.flip(0), scale.flip(0), low.flip(0))  # rows reordered: not the weight any more
    with caplog.at_level(logging.WARNING):
        assert type(int4_of_gguf(linear, reordered)) is GroupedInt8Linear
    assert "do not give back its weight" in caplog.text
    # a Q4_K tensor: its scale terms kept, unless they do not give its scales
    linear = nn.Linear(256, 48)
    groups = q4_k_groups(48, 256, seed=2)
    code, scale, low = groups[:3]
    linear.weight.data = (code.float().reshape(48, -1, GROUP) * scale[..., None] + low[..., None]).reshape(48, 256)
    layer = int4_of_gguf(linear, groups)
    assert type(layer) is GroupedQ4KLinear and torch.equal(layer.dequantized(), linear.weight.data)
    wrong = (*groups[:5], groups[5].flip(0), groups[6])
    with caplog.at_level(logging.WARNING):
        assert type(int4_of_gguf(linear, wrong)) is GroupedInt4Linear
    assert "scale terms do not give its scales" in caplog.text
    # a Q6_K tensor: its own codes and scales, unless they do not give back its weight
    terms = q6_k_terms(48, 256, seed=2)
    linear.weight.data = six_bit_values(terms)
    assert type(int4_of_gguf(linear, terms)) is GroupedQ6KLinear
    with caplog.at_level(logging.WARNING):
        assert type(int4_of_gguf(linear, terms._replace(sc=terms.sc.flip(0)))) is GroupedInt8Linear
    assert "Q6_K tensor's terms do not give back its weight" in caplog.text
    # a float weight is not passed to int4_of_gguf: the int4 target's converter gives int8 codes
    assert linear_converter("target", torch.device("cpu"), precision="int4") is GroupedInt8Linear


def test_an_int4_targets_draft_steps_on_the_kernel_and_reads_prompts_in_int8():
    """Its layers' short passes on the int4 kernel, long ones on torch's int8; its output layer, which reads one row
    a pass, on the int4 kernel alone, and FR-Spec's pruned copy of it gives the kept rows' logits bit for bit."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    from engine.exact.optimize import DRAFT_NARROW_ROWS, Int4Draft, linear_converter
    from engine.exact.vocab import prune_head

    convert = linear_converter("draft", CPU, int8=True, precision="int4")
    draft = finish(convert_linears(tiny_llama(512, seed=1), convert), "draft")
    layers = [m for m in draft.modules() if isinstance(m, Int4Draft)]
    assert len(layers) == 2 * 7 and type(draft.lm_head) is GroupedInt4Linear
    kept = torch.tensor([0, 3, 4, 17, 100, 257, 300, 511])
    hidden = torch.randn(3, 64)
    assert torch.equal(prune_head(draft.lm_head, kept)(hidden), draft.lm_head(hidden)[:, kept])
    layer, x = layers[0], torch.randn(1, 40, 64)
    short, long = x[:, :DRAFT_NARROW_ROWS], x
    assert torch.equal(layer(short), layer.narrow(short)) and torch.equal(layer(long), layer.wide(long))
    assert type(linear_converter("draft", CPU, int8=True, precision="int8")(nn.Linear(64, 8))) is DynamicLinear


@pytest.mark.parametrize("model, qtype", [("smollm2-135m-instruct", 3), ("qwen2.5-coder-1.5b-instruct", 12)])
def test_four_bit_groups_are_the_files_values_bitwise(model, qtype):
    """Q4_1 (SmolLM2) and Q4_K (the default target): scale * q + low is what the dequantization gives, bit for bit."""
    from engine.loading.gguf_dequant import dequantize, four_bit_groups
    from engine.loading.gguf_load import tensor_index
    from engine.loading.weights import gguf_model

    gguf, meta = gguf_model(model)
    entry = next(e for e in tensor_index(gguf, meta)["tensors"] if e["type"] == qtype and e["name"].startswith("blk"))
    raw = np.memmap(gguf, dtype=np.uint8, mode="r", offset=entry["offset"], shape=(entry["nbytes"],))
    data = raw.view(np.dtype(entry["dtype"])).reshape(entry["shape"])
    code, scale, low, *terms = four_bit_groups(data, qtype)
    values = code.float().reshape(*scale.shape, GROUP) * scale[..., None] + low[..., None]
    assert int(code.max()) <= 15 and torch.equal(values.reshape(code.shape), torch.from_numpy(dequantize(data, qtype)))
    assert len(terms) == (4 if qtype == 12 else 0)  # Q4_K: d, dmin, sc, m
    if terms:
        d, dmin, sc, m = terms
        d, dmin = (t.float().repeat_interleave(SUPER, dim=1) for t in (d, dmin))
        assert torch.equal((d * sc.float()).view(torch.int32), scale.view(torch.int32))
        assert torch.equal((-(dmin * m.float())).view(torch.int32), low.view(torch.int32))
    assert four_bit_groups(data, 14) is None  # Q6_K: not 4-bit groups


def test_six_bit_terms_are_the_files_values_bitwise():
    """The default target's Q6_K tensors (its head, half its down projections): six_bit_terms' values are what the
    dequantization gives, bit for bit."""
    from engine.loading.gguf_dequant import dequantize, six_bit_terms
    from engine.loading.gguf_load import tensor_index
    from engine.loading.weights import gguf_model

    gguf, meta = gguf_model("qwen2.5-coder-1.5b-instruct")
    entries = [e for e in tensor_index(gguf, meta)["tensors"] if e["type"] == 14]
    assert {e["name"] for e in entries} >= {"output.weight", "blk.0.ffn_down.weight"}
    for entry in [e for e in entries if e["name"].startswith("blk")][:3]:  # not the 233 M weights of the head
        raw = np.memmap(gguf, dtype=np.uint8, mode="r", offset=entry["offset"], shape=(entry["nbytes"],))
        data = raw.view(np.dtype(entry["dtype"])).reshape(entry["shape"])
        terms = six_bit_terms(data, 14)
        assert int(terms.code.max()) == 63 and terms.sc.dtype == torch.int8
        assert torch.equal(six_bit_values(terms), torch.from_numpy(dequantize(data, 14)).reshape(terms.code.shape))
    assert six_bit_terms(data, 12) is None  # Q4_K: four_bit_groups'


def test_an_int4_gguf_target_is_stored_mapped_and_greedy_exact(tmp_path, monkeypatch):
    """SmolLM2's GGUF (Q4_1 Linears, a Q8_0 embedding that is also its head) as an int4 target: the Linears keep the
    file's codes (int4), the head gets int8 codes; the stored form maps back with the same logits; and the local
    engine's greedy speculative output equals its baseline's on real weights, drafting with the model itself (its
    Linears on the int4 kernel) and with n-grams."""
    from engine.exact.backend import LocalBackend
    from engine.exact.forward import forward, new_cache
    from engine.exact import int8_store
    from engine.exact.models import load
    from engine.exact.optimize import Int4Draft
    from engine.metrics import compare
    from engine.presets import custom_preset
    from engine.drafting import Drafting
    from engine.request import Request
    from tests.test_real_weights import PROMPTS, run

    monkeypatch.setattr(int8_store, "cache_dir", lambda: tmp_path)
    built = load("smollm2-135m-instruct", "target", CPU, precision="int4")
    layers = [m for m in built.model.modules() if isinstance(m, GroupedInt8Linear)]
    assert len([m for m in layers if isinstance(m, GroupedInt4Linear)]) == len(layers) - 1 == 30 * 7
    assert type(built.model.lm_head) is GroupedInt8Linear and built.name.endswith("(int4)")
    [stored] = (tmp_path / "int4").glob("*.pt")
    mapped = load("smollm2-135m-instruct", "target", CPU, precision="int4")
    assert isinstance(mapped.model.model.layers[0].mlp.down_proj, GroupedInt4Linear)
    ids = list(range(100, 140))
    assert torch.equal(forward(mapped.model, ids, new_cache(mapped.model), keep=5),
                       forward(built.model, ids, new_cache(built.model), keep=5))
    assert stored.stat().st_size < built.nbytes * 1.1

    # SmolLM2 drafting for itself: the draft's Linears on the int4 kernel (engine.exact.optimize.Int4Draft)
    backend = LocalBackend.from_preset(custom_preset("smollm2-ngram", None, "smollm2-135m-instruct"), precision="int4")
    assert [m for m in backend.draft.model.modules() if isinstance(m, Int4Draft)]
    for prompt, method in zip(PROMPTS[:2], ("draft", "ngram")):
        req = Request(prompt=prompt, max_new_tokens=40, drafting=Drafting(method=method, k=4, dynamic_k=True))
        b, s = run(backend, req, "baseline"), run(backend, req, "speculative")
        c = compare(b, s, greedy=True)
        assert c.identical, f"first divergence at token {c.first_divergence}"
        assert s.metrics.accepted > 0


def test_the_default_is_int4_where_its_kernel_runs_and_float32_where_it_cannot(tmp_path, smol_tokenizer, monkeypatch):
    """launch.py's default, --precision auto: the int4 target here, where the kernel runs; on a machine without a
    compiler or ninja (here: a PATH without them), the float32 target, and the status line says why."""
    from specconsole.cli import parsers
    from specconsole.backends import local_host

    model = tmp_path / "tiny"
    tiny_llama(len(smol_tokenizer), seed=3).save_pretrained(model)
    smol_tokenizer.save_pretrained(model)
    parser, _ = parsers()
    args = parser.parse_args(["demo", "--preset", "smollm2-ngram", "--target", str(model), "--prompt", "Hi"])
    host = local_host(args)
    backend = host.factory(None)  # the engines in their engine process: what it loaded, as it says
    try:
        assert backend.why_float32() is None
        assert backend.describe()["target_model"].endswith("(int4)") and "(int4)" in host.label
    finally:
        backend.close()

    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))  # the engine process inherits it
    backend = host.factory(None)
    try:
        assert "cannot run here" in backend.why_float32()
        assert not backend.describe()["target_model"].endswith(")")
    finally:
        backend.close()
    assert "(float32: the int4 kernel cannot run here: it is compiled on first use and needs a C++" in host.label
    # the kernel's Linears, in this process, built as the engine process builds them
    from specconsole.backends import local_factory

    monkeypatch.undo()
    loaded = local_factory(args)(None)
    assert loaded.precision == "int4" and [m for m in loaded.target.model.modules()
                                           if isinstance(m, GroupedInt8Linear)]


@pytest.mark.slow  # two loads of the 1.5B target from its GGUF and one stored form: a minute or two
def test_the_default_targets_q4_k_form_is_stored_mapped_and_gives_the_float32_scales_tokens(tmp_path):
    """The default int4 target (Qwen2.5-Coder 1.5B, Q4_K_M) with its Q4_K Linears in the scale form, built and then
    mapped from its stored form, against the same GGUF with float32 scales: the logits of a prompt bit for bit, and
    the greedy baseline's tokens on two prompts."""
    from transformers import AutoTokenizer

    from engine.exact.backend import LocalBackend
    from engine.exact.forward import forward, new_cache
    from engine.exact.int8_store import load_stored, save
    from engine.exact.models import LoadedModel
    from engine.loading.gguf_load import load_gguf_model, tensor_index
    from engine.loading.weights import gguf_model
    from engine.request import Request
    from tests.test_real_weights import PROMPTS, run

    gguf, meta = gguf_model("qwen2.5-coder-1.5b-instruct")
    convert = linear_converter("target", CPU, precision="int4")
    compact = finish(load_gguf_model(gguf, meta, convert, own_codes=int4_of_gguf), "target")
    floats = finish(load_gguf_model(gguf, meta, convert, own_codes=lambda linear, groups: int4_of_gguf(
        linear, groups if isinstance(groups, SixBitTerms) else groups[:3])), "target")
    forms = [[type(m) for m in model.modules() if isinstance(m, GroupedInt8Linear)] for model in (compact, floats)]
    assert forms[0].count(GroupedQ4KLinear) > 100 and GroupedQ4KLinear not in forms[1]
    q6_k = sum(e["type"] == 14 for e in tensor_index(gguf, meta)["tensors"])  # the head, attn_v and ffn_down of some
    assert forms[0].count(GroupedQ6KLinear) == q6_k > 14
    assert GroupedInt8Linear not in forms[0]  # every Linear on the file's own codes
    save(compact, tmp_path / "target.pt")
    mapped = finish(load_stored(tmp_path / "target.pt", meta), "target")
    assert type(mapped.model.layers[0].mlp.gate_proj) is GroupedQ4KLinear
    assert type(mapped.lm_head) is GroupedQ6KLinear and type(mapped.model.layers[0].mlp.down_proj) is GroupedQ6KLinear

    tokenizer = AutoTokenizer.from_pretrained(meta)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    logits = [forward(model, ids, new_cache(model), keep=len(ids)) for model in (compact, mapped, floats)]
    assert torch.equal(logits[0], logits[2]) and torch.equal(logits[1], logits[2])
    for prompt in PROMPTS[:2]:
        req = Request(prompt=prompt, max_new_tokens=24)
        outputs = [run(LocalBackend(LoadedModel(name, model, tokenizer, CPU)), req, "baseline").output_ids
                   for name, model in (("q4_k", mapped), ("float32 scales", floats))]
        assert outputs[0] == outputs[1] and len(outputs[0]) > 0
