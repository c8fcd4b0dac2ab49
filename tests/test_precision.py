"""The float16 target (engine.exact.precision): each row of a pass is what a one-row pass gives, so greedy speculative
output still equals the baseline's; and the option reaches the loaded model."""

import pytest
import torch
from torch import nn

from engine.exact.optimize import MIN_ROWS, free_rows, linear_converter, prepare_draft, prepare_target
from engine.exact.precision import ROW_MULTIPLES, HalfLinear, fp16_available, row_multiple
from tests.conftest import CPU, perturbed, tiny_llama
from tests.test_greedy_exact import *  # the greedy identity tests, collected here again: they use tiny_pair below

pytestmark = pytest.mark.skipif(not fp16_available(CPU), reason="float16 Linears need torch's fbgemm (x86)")

ROWS = [*range(1, 41), 64, 65, 100, 257]  # single steps, verify passes up to MAX_K + 1 + a tree, prompts


@pytest.fixture(scope="module")
def tiny_pair():
    """conftest's tiny_pair with the target's Linears in float16: test_greedy_exact's tests (imported above) use it."""
    target = tiny_llama(512, seed=1)
    draft = perturbed(target, 0.6, seed=2)
    return prepare_target(target, CPU, precision="float16"), prepare_draft(draft, CPU, int8=False)


@pytest.mark.parametrize("shape", [(64, 96), (1536, 1536), (1536, 8960), (8960, 1536)])  # (in, out)
def test_every_pass_size_gives_each_row_what_a_single_row_gives(shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(*shape)
    x = torch.randn(1, 300, shape[0])
    half = HalfLinear(linear)
    long = half(x)
    for rows in ROWS:
        assert torch.equal(half(x[:, :rows]), long[:, :rows]), f"a {rows}-row pass differs from a 300-row pass"
    for i in range(0, 300, 23):
        assert torch.equal(half(x[:, i : i + 1]), long[:, i : i + 1]), f"row {i} alone differs"
    # the layer with its weights rounded to float16; sums in float32
    rounded = x @ linear.weight.detach().half().float().T + linear.bias.detach()
    assert torch.allclose(long, rounded, atol=1e-4, rtol=1e-5)


def test_the_probed_row_multiple_is_the_smallest_exact_one():
    """Padding to row_multiple() makes every pass size exact (the test above); a smaller multiple of ROW_MULTIPLES does
    not, on this CPU (on AVX2 without AVX-512 fbgemm's last 1-2 rows of a block of 6 take another kernel)."""
    torch.manual_seed(0)
    linear, x = torch.nn.Linear(1536, 1536), torch.randn(1, 300, 1536)
    for multiple in ROW_MULTIPLES[: ROW_MULTIPLES.index(row_multiple())]:
        layer = HalfLinear(linear, multiple=multiple)
        long = layer(x)
        assert not all(torch.equal(layer(x[:, :rows]), long[:, :rows]) for rows in ROWS), multiple
    assert HalfLinear(linear).multiple == row_multiple()


def test_prepare_target_converts_every_linear_and_keeps_float32_the_default():
    half = prepare_target(tiny_llama(512, seed=1), CPU, precision="float16")
    assert not [m for m in half.modules() if isinstance(m, torch.nn.Linear)]
    assert len([m for m in half.modules() if isinstance(m, HalfLinear)]) == 2 * 7 + 1  # 2 layers of 7, the head
    default = prepare_target(tiny_llama(512, seed=1), CPU)
    assert not [m for m in default.modules() if isinstance(m, HalfLinear)]


def test_the_converter_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="precision"):
        linear_converter("target", CPU, precision="int2")
    with pytest.raises(ValueError, match="CPU"):
        linear_converter("target", torch.device("cuda"), precision="float16")
    linear = torch.nn.Linear(8, 4)
    assert isinstance(linear_converter("target", CPU, precision="float16")(linear), HalfLinear)
    assert linear_converter("draft", CPU, precision="float16")(linear) is linear  # a target option: drafts keep theirs


def test_load_makes_a_float16_target_and_counts_its_bytes(tmp_path, smol_tokenizer):
    from engine.exact.models import ModelError, load

    tiny_llama(len(smol_tokenizer), seed=3).save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    full = load(str(tmp_path), "target", CPU)
    half = load(str(tmp_path), "target", CPU, precision="float16")
    assert [m for m in half.model.modules() if isinstance(m, HalfLinear)]
    linear_params = sum(m.in_features * m.out_features for m in half.model.modules() if isinstance(m, HalfLinear))
    # 2 bytes a weight instead of 4; the float16 figure also counts the rotary tables (non-persistent buffers)
    assert 0 <= half.nbytes - (full.nbytes - 2 * linear_params) < 1024
    with pytest.raises(ModelError, match="precision"):
        load(str(tmp_path), "target", CPU, precision="int2")


def test_the_command_line_option_reaches_the_target(tmp_path, smol_tokenizer):
    """launch.py --precision float16: the local engine's target runs HalfLinears (a tiny model as --target)."""
    from specconsole.cli import parsers
    from specconsole.backends import local_factory, local_host

    tiny_llama(len(smol_tokenizer), seed=3).save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    parser, _ = parsers()
    # float16's target says so in its name, and has no token tree (its rows are not free); float32's does (the
    # default, auto, is tests/test_int4_target.py's)
    for option, layers, tree_rows in ((["--precision", "float16"], 2 * 7 + 1, 0),
                                      (["--precision", "float32"], 0, MIN_ROWS)):
        args = parser.parse_args(["demo", "--preset", "smollm2-ngram", "--target", str(tmp_path), "--prompt", "Hi",
                                  *option])
        engines = local_host(args).factory(None)  # in the engine process, as the console runs them
        try:
            assert engines.describe()["target_model"].endswith("(float16)") == bool(layers)
        finally:
            engines.close()
        backend = local_factory(args)(None)  # the same build, here, to look inside
        assert len([m for m in backend.target.model.modules() if isinstance(m, HalfLinear)]) == layers
        assert not [m for m in backend.target.model.modules() if isinstance(m, nn.Linear)]
        assert backend.tree_rows == tree_rows == free_rows(backend.target.model)
        assert backend.describe()["target_model"].endswith("(float16)") == bool(layers)


def test_the_token_tree_follows_the_targets_linears(smol_tokenizer):
    """A backend built by hand (not from a preset) still gets no tree with a float16 target, and the padding's rows
    with a float32 one: the rule reads the target's Linears, not the options it was loaded with."""
    from engine.exact.backend import LocalBackend
    from engine.exact.models import LoadedModel

    half = prepare_target(tiny_llama(512, seed=1), CPU, precision="float16")
    assert LocalBackend(LoadedModel("tiny", half, smol_tokenizer, CPU)).tree_rows == 0
    padded = prepare_target(tiny_llama(512, seed=1), CPU, min_rows=3)
    assert LocalBackend(LoadedModel("tiny", padded, smol_tokenizer, CPU)).tree_rows == 3
    assert LocalBackend(LoadedModel("tiny", padded, smol_tokenizer, CPU), tree_rows=0).tree_rows == 0
    assert free_rows(tiny_llama(512, seed=1)) == MIN_ROWS  # plain Linears (a GPU's target): as before


def test_precision_benchmark_times_every_variant_in_turns(capsys):
    from benchmarks.target_precision import VARIANTS, main

    assert main(["--blocks", "1", "--rows", "1", "2", "--repeats", "2", "--int8-max-rows", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    head, one, two = table[-4], table[-2], table[-1]
    assert all(name in head for name in VARIANTS)
    assert one.startswith("| 1 |") and "not run" not in one and one.count("x |") == len(VARIANTS)
    assert two.startswith("| 2 |") and two.count("not run") == 2  # the int8 candidates stop at --int8-max-rows
