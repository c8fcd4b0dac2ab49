"""The int8 target (engine.exact.grouped_int8): each row of a pass is what a one-row pass gives, so greedy speculative
output still equals the baseline's; the kernel computes what its docstring says; the option reaches the model."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.exact import grouped_int8
from engine.exact.grouped_int8 import GROUP, GroupedInt8Linear, quantize
from engine.exact.optimize import free_rows, linear_converter, prepare_draft, prepare_target
from tests.conftest import CPU, perturbed, skip_or_fail, tiny_llama

# the greedy identity tests, collected here again with tiny_pair below. Not test_token_tree and test_hybrid: besides
# identity they need this pair's draft to win a tree branch and to meet an n-gram, which it happens not to; an int8
# target gets no tree anyway (free_rows), and test_token_tree_branch_after_accepted_drafts scripts a tree's win.
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
    skip_or_fail(f"the int8 target cannot run here: {grouped_int8.unavailable()}", module=True)

ROOT = Path(__file__).resolve().parent.parent
SEED = 3  # the draft's: one with which this pair yields every kind of token
ROWS = [*range(1, 41), 64, 65, 100, 257]  # single steps, verify passes up to MAX_K + 1 + a tree, prompts


@pytest.fixture(scope="module")
def tiny_pair():
    """conftest's tiny_pair with the target's Linears in int8: test_greedy_exact's tests (imported above) use it."""
    target = tiny_llama(512, seed=1)
    draft = perturbed(target, 0.6, seed=SEED)
    return prepare_target(target, CPU, precision="int8"), prepare_draft(draft, CPU, int8=False)


def reference(x: torch.Tensor, layer: GroupedInt8Linear) -> torch.Tensor:
    """The kernel's arithmetic: activations quantized per row and group of 32 (in float32, as the kernel does), then
    the integer group sums and the rest in float64."""
    rows = x.reshape(-1, layer.in_features // GROUP, GROUP)  # [R, groups, GROUP]
    xscale = rows.abs().amax(-1) / 127  # [R, groups]; in float32 as the kernel rounds them
    inverse = torch.where(xscale > 0, 1 / xscale, 0)
    xq, xscale = torch.round(rows * inverse[..., None]).double(), xscale.double()
    code, scale, low = layer.unblocked()
    code = code.double().reshape(layer.out_features, -1, GROUP)  # [N, groups, GROUP]
    dots = torch.einsum("rgk,ngk->rng", xq, code)  # integer sums, exact in float64
    y = (xscale[:, None, :] * (scale.double() * dots + low.double() * xq.sum(-1)[:, None, :])).sum(-1)
    return y + layer.bias.double()


# AVX2's kernel, and AVX-512 VNNI's where the CPU has it (collecting compiles the kernel once, if it can)
VNNI = [False] + ([True] if grouped_int8.unavailable() is None and grouped_int8.kernel().vnni_supported() else [])


@pytest.mark.parametrize("vnni", VNNI)
@pytest.mark.parametrize("shape", [(64, 96), (96, 40), (896, 4864), (1536, 256), (8960, 1536)])  # (in, out)
def test_every_pass_size_gives_each_row_what_a_single_row_gives(shape, vnni):
    torch.manual_seed(0)
    linear = nn.Linear(*shape)
    x = torch.randn(1, 300, shape[0]) * torch.rand(1, 300, 1) * 4  # rows of different ranges: a batch scale would fail
    layer = GroupedInt8Linear(linear)
    layer.vnni = vnni
    long = layer(x)
    for rows in ROWS:
        assert torch.equal(layer(x[:, :rows]), long[:, :rows]), f"a {rows}-row pass differs from a 300-row pass"
    for i in range(0, 300, 23):
        assert torch.equal(layer(x[:, i: i + 1]), long[:, i: i + 1]), f"row {i} alone differs"
    if vnni:
        layer.vnni = False
        assert torch.equal(layer(x), long), "AVX2's kernel and VNNI's differ"
    # float32 sums over up to 280 groups against float64's
    assert torch.allclose(long[0].double(), reference(x, layer), rtol=1e-5, atol=1e-5 * long.abs().max().item())


def test_the_codes_stand_for_the_weights_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(40, 96)
    weight[3, :GROUP] = 0.5  # a constant group: one code, exact
    code, scale, low = quantize(weight, chunk=16)
    assert code.dtype == torch.uint8 and int(code.max()) <= grouped_int8.LEVELS and scale.shape == (40, 96 // GROUP)
    back = (code.float().reshape(40, -1, GROUP) * scale[..., None] + low[..., None]).reshape(40, 96)
    step = scale.repeat_interleave(GROUP, dim=1)
    assert ((back - weight).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(back[3, :GROUP], weight[3, :GROUP])
    # a group on a 16-level grid that uses both ends (a GGUF Q4_K group's shape) comes back exactly: 120 = 15 * 8
    grid = -0.3 + 0.02 * torch.tensor([0, 15] + [i % 16 for i in range(GROUP - 2)], dtype=torch.float32)
    code, scale, low = quantize(grid[None])
    assert torch.allclose(code.float() * scale[0, 0] + low[0, 0], grid[None], rtol=0, atol=1e-7)


def test_the_converter_makes_int8_layers_and_no_tree():
    model = prepare_target(tiny_llama(512, seed=1), CPU, precision="int8")
    assert not [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len([m for m in model.modules() if isinstance(m, GroupedInt8Linear)]) == 2 * 7 + 1  # 2 layers of 7, head
    assert free_rows(model) == 0  # extra rows are not free: no token tree
    with pytest.raises(ValueError, match="CPU"):
        linear_converter("target", torch.device("cuda"), precision="int8")
    with pytest.raises(ValueError, match="multiple of 32"):
        GroupedInt8Linear(nn.Linear(40, 8))


def test_a_machine_without_a_compiler_is_told_why(monkeypatch):
    from engine.exact.precision import check_precision

    monkeypatch.setattr(grouped_int8.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="C\\+\\+ compiler and ninja.*use float32 or float16"):
        check_precision("int8", CPU)


def test_load_makes_an_int8_target_and_counts_its_bytes(tmp_path, smol_tokenizer):
    from engine.exact.models import load

    tiny_llama(len(smol_tokenizer), seed=3).save_pretrained(tmp_path)
    smol_tokenizer.save_pretrained(tmp_path)
    full = load(str(tmp_path), "target", CPU)
    small = load(str(tmp_path), "target", CPU, precision="int8")
    layers = [m for m in small.model.modules() if isinstance(m, GroupedInt8Linear)]
    assert layers and small.name.endswith("(int8)")
    weights = sum(m.in_features * m.out_features for m in layers)
    # a byte a weight and two float32 a group instead of 4 bytes a weight; the rotary tables (non-persistent) too
    assert 0 <= small.nbytes - (full.nbytes - 4 * weights + weights + 8 * weights // GROUP) < 1024


def test_the_stored_form_is_mapped_next_time_and_computes_the_same(tmp_path, monkeypatch):
    """A GGUF target in int8 is stored once in its running form, in place of the same GGUF's file of an older format;
    the next load maps it (nothing is quantized) and gives the same logits bit for bit; a damaged file is built again.
    SmolLM2's GGUF: its head is tied."""
    from engine.exact.forward import forward, new_cache
    from engine.exact import int8_store
    from engine.exact.models import load
    from engine.loading.weights import gguf_model

    def logits(loaded):
        return forward(loaded.model, list(range(100, 140)), new_cache(loaded.model), keep=5)

    monkeypatch.setattr(int8_store, "cache_dir", lambda: tmp_path)
    current = int8_store.store_path(gguf_model("smollm2-135m-instruct")[0], "int8")
    stem = current.name.removesuffix(f"-v{int8_store.FORMAT}.pt")
    older, newer, others = (current.with_name(f"{stem}-v{int8_store.FORMAT - 1}.pt"),
                            current.with_name(f"{stem}-v{int8_store.FORMAT + 1}.pt"),
                            [current.with_name(f"another-{stem}-v1.pt"), current.with_name(f"{stem}-v1-notes.pt")])
    older.parent.mkdir()
    for path in (older, newer, *others):
        path.write_bytes(b"a file this checkout does not read")
    built = load("smollm2-135m-instruct", "target", CPU, precision="int8")
    stored = current
    # the older format's file is gone (nothing reads it again); a newer format's and other GGUFs' files stay
    assert sorted(p.name for p in (tmp_path / "int8").glob("*.pt")) == sorted(
        p.name for p in (current, newer, *others))
    quantize_for_real = grouped_int8.quantize

    def refuse(*args, **kwargs):
        raise AssertionError("a stored target was quantized again")

    monkeypatch.setattr(grouped_int8, "quantize", refuse)
    mapped = load("smollm2-135m-instruct", "target", CPU, precision="int8")
    assert torch.equal(logits(mapped), logits(built)) and mapped.nbytes == built.nbytes
    monkeypatch.setattr(grouped_int8, "quantize", quantize_for_real)
    stored.write_bytes(b"half a file")
    rebuilt = load("smollm2-135m-instruct", "target", CPU, precision="int8")
    assert torch.equal(logits(rebuilt), logits(built)) and stored.stat().st_size > 10**6


def test_a_cache_that_cannot_store_the_form_still_loads(tmp_path, monkeypatch):
    """A read-only (or full) cache: the int8 target loads all the same, and no partial file is left."""
    from engine.exact import int8_store
    from engine.exact.models import load

    def full_disk(*args, **kwargs):
        raise OSError("No space left on device")

    (tmp_path / "int8").mkdir()
    (tmp_path / "int8").chmod(0o500)
    monkeypatch.setattr(int8_store, "cache_dir", lambda: tmp_path)
    try:
        if os.access(tmp_path / "int8", os.W_OK):  # root ignores the mode: the disk is full instead
            monkeypatch.setattr(int8_store.torch, "save", full_disk)
        loaded = load("smollm2-135m-instruct", "target", CPU, precision="int8")
        assert [m for m in loaded.model.modules() if isinstance(m, GroupedInt8Linear)]
        assert not list((tmp_path / "int8").iterdir())
    finally:
        (tmp_path / "int8").chmod(0o700)


@pytest.mark.slow
def test_a_killed_build_and_two_starts_at_once_each_get_the_kernel(tmp_path):
    """A start killed mid-compile leaves nothing a later start waits for, and two starts at once on an empty cache
    both get the kernel (torch's lock file in one build directory shared by every checkout once hung every later
    start); a start after them loads the built module without compiling."""
    env = dict(os.environ, SPECCONSOLE_CACHE=str(tmp_path))
    load = [sys.executable, "-c", "from engine.exact.grouped_int8 import kernel; print(kernel().vnni_supported())"]
    kernels = tmp_path / "kernels"
    killed = subprocess.Popen(load, cwd=ROOT, env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(kernels.glob(".build-*/lock")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(kernels.glob(".build-*/lock")), "the first start never began compiling"
    os.killpg(killed.pid, signal.SIGKILL)  # the compiler with it, as a closed terminal does
    killed.wait(30)

    starts = [subprocess.Popen(load, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = [p.communicate(timeout=900)[0] for p in starts]
    assert [p.returncode for p in starts] == [0, 0], outputs
    left = sorted(d.name for d in kernels.iterdir())
    # the built module, and the killed start's directory (swept once it is STALE_BUILD_S old)
    assert [n for n in left if not n.startswith(".build-")] == [f"grouped_int8-{grouped_int8.build_key()}"], left
    assert len(left) == 2, left

    again = subprocess.run(load, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split()[-1:] == outputs[0].split()[-1:], (again.stdout, outputs[0])
    assert sorted(d.name for d in kernels.iterdir()) == left  # loaded, not built again


@pytest.mark.slow
def test_a_build_leaves_the_build_key_as_it_was(tmp_path):
    """torch's load() appends its libraries to the flag list it is given: given ours, it changed build_key() in the
    process that compiled, and that process then named the built module differently from every other start."""
    env = dict(os.environ, SPECCONSOLE_CACHE=str(tmp_path))
    code = ("from engine.exact import grouped_int8 as g; before = g.build_key(); g.kernel(); "
            "print(before, g.build_key())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.split()[-2:]
    assert before == after
    assert (tmp_path / "kernels" / f"grouped_int8-{before}").is_dir()
