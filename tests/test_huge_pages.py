"""engine.exact.huge_pages: a model's weights moved into one mapping advised MADV_HUGEPAGE compute the same bits, and
the console's int4 target and draft are loaded that way."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from engine.exact import huge_pages
from engine.exact.forward import forward, new_cache

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                                reason="this kernel has no transparent huge pages")


def _tensors(model):
    return list({id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


def test_moved_weights_give_the_same_bits_in_one_advised_mapping():
    from tests.conftest import tiny_llama
    from engine.exact.optimize import prepare_target

    target = prepare_target(tiny_llama(512, seed=1), CPU, min_rows=1, precision="int8")  # our kernel's Linears
    ids = list(range(3, 40))
    before = forward(target, ids, new_cache(target), keep=5)
    objects = [id(t) for t in _tensors(target)]
    huge_pages.move(target)
    assert [id(t) for t in _tensors(target)] == objects  # the same Parameter objects, their data moved
    moved = huge_pages.read_in_full(target)
    assert len(moved) == len(_tensors(target)) - 1  # all but the embedding's rows
    where = {huge_pages.mapping(t.data_ptr()).get("range") for t in moved}
    assert len(where) == 1 and None not in where
    assert "hg" in huge_pages.mapping(moved[0].data_ptr())["VmFlags"].split()
    assert huge_pages.mapping(target.get_input_embeddings().weight.data_ptr()).get("range") not in where
    assert torch.equal(forward(target, ids, new_cache(target), keep=5), before)


def test_two_models_move_into_one_mapping_and_keep_their_bits():
    """The console moves its target and its draft together."""
    from tests.conftest import tiny_llama
    from engine.exact.optimize import prepare_target

    target = prepare_target(tiny_llama(512, seed=1), CPU, min_rows=1, precision="int8")
    draft = prepare_target(tiny_llama(512, seed=2), CPU, min_rows=1, precision="int8")
    ids = list(range(3, 40))
    before = [forward(m, ids, new_cache(m), keep=5) for m in (target, draft)]
    huge_pages.move(target, draft)
    moved = huge_pages.read_in_full(target) + huge_pages.read_in_full(draft)
    assert len({huge_pages.mapping(t.data_ptr()).get("range") for t in moved}) == 1
    after = [forward(m, ids, new_cache(m), keep=5) for m in (target, draft)]
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_a_tensor_shared_by_two_modules_stays_shared():
    a, b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    b.weight = a.weight
    model = torch.nn.Sequential(a, b)
    x = torch.randn(3, 64)
    before = model(x)
    huge_pages.move(model)
    assert a.weight.data_ptr() == b.weight.data_ptr()
    assert torch.equal(model(x), before)


def test_a_mapping_nobody_advised_is_not_marked():
    """The check above can fail: a fresh anonymous mapping is not advised. (A fresh one, not heap memory, which other
    code in a long test process may have advised.)"""
    region = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.uint8)
    t.fill_(1)
    fields = huge_pages.mapping(t.data_ptr())
    assert fields and "hg" not in fields["VmFlags"].split()


@pytest.mark.slow  # SmolLM2's int4 target and draft built, stored and read back: 40 s
def test_the_int4_target_and_its_draft_are_in_huge_pages_and_greedy_stays_exact(tmp_path, monkeypatch):
    """SmolLM2 as an int4 target drafting for itself, as the console loads it (built, then read back from its stored
    form): the target's and the draft's weights in one advised mapping, greedy still exact."""
    from engine.exact import int8_store
    from engine.exact.backend import LocalBackend
    from engine.metrics import compare
    from engine.presets import custom_preset
    from engine.drafting import Drafting
    from engine.request import Request
    from tests.test_real_weights import PROMPTS, run

    monkeypatch.setattr(int8_store, "cache_dir", lambda: tmp_path)
    preset = custom_preset("smollm2-ngram", None, "smollm2-135m-instruct")
    for _ in range(2):
        backend = LocalBackend.from_preset(preset, precision="int4", calibrate=False)
        weights = huge_pages.read_in_full(backend.target.model) + huge_pages.read_in_full(backend.draft.model)
        assert len({huge_pages.mapping(t.data_ptr()).get("range") for t in weights}) == 1
        assert "hg" in huge_pages.mapping(weights[0].data_ptr())["VmFlags"].split()
    req = Request(prompt=PROMPTS[0], max_new_tokens=24, drafting=Drafting(method="draft", k=3))
    assert compare(run(backend, req, "baseline"), run(backend, req, "speculative"), greedy=True).identical


def test_a_mapped_tensor_is_read_from_its_file_without_faulting_its_pages_in(tmp_path):
    """A stored target is mapped from its file: its tensors are read from the file, so the process never holds the
    file's pages beside the copy (and does not pay a page fault per 4 KiB). The mapping stays (as the embedding's
    rows keep it in the console), and its pages were never touched."""
    torch.save({"w": torch.randn(1024, 1024)}, tmp_path / "w.pt")
    expected = torch.load(tmp_path / "w.pt")["w"]
    kept = torch.load(tmp_path / "w.pt", mmap=True)
    layer = torch.nn.Linear(1024, 1024, bias=False)
    layer.weight = torch.nn.Parameter(kept["w"], requires_grad=False)
    old = layer.weight.data_ptr()
    huge_pages.move(layer)
    assert layer.weight.data_ptr() != old and torch.equal(layer.weight, expected)
    assert _kb(huge_pages.mapping(old)["Rss"]) <= 8


def test_a_mapped_tensor_written_to_is_copied_with_what_was_written(tmp_path):
    """Written to since it was mapped, a private mapping holds other bytes than its file: those are the ones kept."""
    torch.save({"w": torch.zeros(1024, 1024)}, tmp_path / "w.pt")
    kept = torch.load(tmp_path / "w.pt", mmap=True)
    layer = torch.nn.Linear(1024, 1024, bias=False)
    layer.weight = torch.nn.Parameter(kept["w"], requires_grad=False)
    layer.weight.data[3, 5] = 7.0
    huge_pages.move(layer)
    assert layer.weight[3, 5] == 7.0 and layer.weight.sum() == 7.0


def _kb(field: str) -> int:
    return int(field.split()[0])
