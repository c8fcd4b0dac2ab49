"""The target's exact kernels: a short pass padded to MIN_ROWS rows gives each row what a longer pass gives it."""

import pytest
import torch

from engine.exact.optimize import MIN_ROWS, PackedLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PackedLinear needs oneDNN")


@pytest.mark.parametrize("shape", [(64, 96), (1536, 8960)])  # a tiny layer, and the default target's MLP up-projection
def test_short_passes_give_the_rows_of_a_long_pass(shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(*shape)
    x = torch.randn(1, 12, shape[0])
    packed = PackedLinear(linear)
    long = packed(x)  # [1, 12, out]: no padding at this length
    for rows in range(1, MIN_ROWS + 2):
        y = packed(x[:, :rows])
        assert y.shape == (1, rows, shape[1])
        assert torch.equal(y, long[:, :rows]), f"{rows} rows differ from the same rows of a 12-row pass"
    assert torch.allclose(long, linear(x), atol=1e-4)  # and it is still the layer


def test_padding_is_what_makes_a_single_row_exact():
    """Without padding (min_rows=1) a single row takes oneDNN's other kernel, whose last bits differ on a layer this
    large; if this ever passes unpadded too, the padding is no longer needed for exactness (only for speed)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(1536, 8960)
    x = torch.randn(1, 8, 1536)
    unpadded, padded = PackedLinear(linear, min_rows=1), PackedLinear(linear)
    assert torch.equal(padded(x[:, :1]), padded(x)[:, :1])
    if torch.equal(unpadded(x[:, :1]), unpadded(x)[:, :1]):
        pytest.skip("this CPU's oneDNN computes a single row bitwise like a longer pass: nothing to show")


def test_pass_cost_times_each_padding_and_restores_the_models(tiny_pair):
    from benchmarks.pass_cost import padded_pass_ms

    target, _ = tiny_pair
    layers = [m for m in target.modules() if isinstance(m, PackedLinear)]
    assert layers and all(layer.min_rows == MIN_ROWS for layer in layers)
    ms = padded_pass_ms(target, list(range(1, 40)), [1, 2, 6], [MIN_ROWS, 1], rounds=3)
    assert sorted(ms) == sorted((m, r) for m in (1, 2, 6) for r in (MIN_ROWS, 1))
    assert all(len(times) == 3 and min(times) > 0 for times in ms.values())
    assert all(layer.min_rows == MIN_ROWS for layer in layers)  # the shared fixture is left as it was loaded


def test_the_benchmarks_context_is_our_own_code(smol_tokenizer):
    """benchmarks.pass_cost, draft_head and stop_replay time passes after a context read from one of our files
    (it moved once, with the engine's subpackages, and the benchmarks failed to start)."""
    from benchmarks.timing import code_context

    context = code_context(smol_tokenizer, 200)
    assert len(context) == 200 and "Proposer" in smol_tokenizer.decode(context)


def test_padding_benchmark_runs_each_engine_under_each_padding(backend):
    from benchmarks.padding import compare
    from engine.request import build_request

    layers = [m for m in backend.target.model.modules() if isinstance(m, PackedLinear)]
    costs = backend.calibrate()
    req = build_request("Write a haiku about the sea.", method="draft", max_new_tokens=12)
    rows = compare(backend, [req, req], paddings=(MIN_ROWS, 1))
    assert [sorted(k for k in row if k != "identical") for row in rows] == [
        sorted((e, r) for e in ("baseline", "speculative") for r in (MIN_ROWS, 1))] * 2
    assert all(row["identical"] for row in rows)  # greedy: padded or not, both engines give the same tokens
    assert all(value > 0 for row in rows for key, value in row.items() if key != "identical")
    assert all(layer.min_rows == MIN_ROWS for layer in layers) and backend.costs is costs  # as it was
