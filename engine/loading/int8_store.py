"""The int8 (or int4) target kept on disk in the form it runs in, and mapped at start instead of computed.

Loading a GGUF as an int8 target dequantizes and quantizes every Linear (engine.exact.grouped_int8): about 10 s of
a start for the 1.5B target. The first such load saves the model's tensors (the Linears' codes, scales and lows,
the norms, the embedding's GGUF rows) to <cache>/<precision>/<gguf name>-<size>-v<FORMAT>.pt; later loads build the
model empty and map that file (torch.load(mmap=True)): nothing is computed, and the pages are read when passes first
need them. A file that does not load is rebuilt. An int4 target's file also lists its Linears with 4-bit codes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from engine.exact.grouped_int8 import GroupedInt4Linear, GroupedInt8Linear
from engine.loading.gguf_load import GGUFEmbedding, _parent, _rebuild_meta_buffers, empty_model, meta_tensors
from engine.loading.weights import cache_dir

log = logging.getLogger(__name__)

FORMAT = 1  # bump when grouped_int8's layout or quantization changes: older files are then not read


def store_path(gguf: Path, precision: str = "int8") -> Path:
    return cache_dir() / precision / f"{gguf.stem}-{gguf.stat().st_size}-v{FORMAT}.pt"


def load_or_build(gguf: Path, meta_dir: Path, build: Callable[[], nn.Module], precision: str = "int8") -> nn.Module:
    """The int8 (or int4) target of `gguf`: mapped from its stored form, or built by `build` (the GGUF loader with
    the precision's converter) and stored for the next start."""
    path = store_path(gguf, precision)
    if path.exists():
        try:
            return load_stored(path, meta_dir)
        except Exception as e:  # noqa: BLE001 - a damaged or foreign file: build it again
            log.warning("the stored int8 form %s does not load (%s): building it again", path, e)
            path.unlink(missing_ok=True)
    model = build()
    try:
        save(model, path)
    except OSError as e:  # a full or read-only cache: this start still runs, the next builds again
        log.warning("could not store the int8 target in %s (%s): the next start quantizes it again", path, e)
    return model


def save(model: nn.Module, path: Path) -> None:
    embeddings = {name: {"qtype": int(m.qtype), "dim": m.embedding_dim}
                  for name, m in model.named_modules() if isinstance(m, GGUFEmbedding)}
    int4 = [name for name, m in model.named_modules() if isinstance(m, GroupedInt4Linear)]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # a stopped save leaves no file that looks whole
    log.info("storing the target's running form in %s (read at the next start instead of computed)", path)
    try:
        torch.save({"state": model.state_dict(), "embeddings": embeddings, "int4": int4}, partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def load_stored(path: Path, meta_dir: Path) -> nn.Module:
    from gguf import GGMLQuantizationType

    stored = torch.load(path, mmap=True, weights_only=True)
    state, int4 = stored["state"], set(stored.get("int4", ()))
    model = empty_model(meta_dir)
    for name, module in list(model.named_modules()):
        parent, attr = _parent(model, name) if name else (None, "")
        if isinstance(module, nn.Linear):
            form = GroupedInt4Linear if name in int4 else GroupedInt8Linear
            setattr(parent, attr, form.shell(module.in_features, module.out_features, module.bias is not None))
        elif name in stored["embeddings"]:
            info = stored["embeddings"][name]  # its rows stay mapped from the file
            embedding = GGUFEmbedding(state[f"{name}.raw"], GGMLQuantizationType(info["qtype"]), info["dim"])
            setattr(parent, attr, embedding)
    model.load_state_dict(state, strict=True, assign=True)
    _rebuild_meta_buffers(model)
    missing = meta_tensors(model)
    if missing:
        raise ValueError(f"{path.name} lacks {missing[:5]}")
    log.info("target mapped from %s", path)
    return model.eval()
