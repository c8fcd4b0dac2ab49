"""The int8 (or int4) target, and the draft beside it, kept on disk in the form they run in and read back at start.

Loading a GGUF as an int8 target dequantizes and quantizes every Linear (engine.exact.grouped_int8): about 10 s of
a start for the 1.5B target. The first such load saves the model's tensors (the Linears' codes, scales and lows,
the norms, the embedding's GGUF rows) to <cache>/<form>/<gguf name>-<size>-v<FORMAT>.pt; later loads build the
model empty and map that file (torch.load(mmap=True)): nothing is computed. LocalBackend.from_preset then reads the
Linears' bytes into huge pages (engine.exact.huge_pages); the embedding's rows stay mapped, read as tokens need
them. A file that does not load is rebuilt, and storing a file removes the same GGUF's files of older formats. An
int4 target's file also lists its Linears with 4-bit codes, those of them with a Q4_K tensor's scale form, and those
with a Q6_K tensor's codes and scales.

Beside such a target the draft's load is the longest part of a start, so the draft is stored too (form
"draft-int8" beside an int8 target, "draft-int4" beside an int4 one), its file listing each Linear's form: torch's
dynamic int8 Linear (its int8 weight is stored; fbgemm packs it again at load, most of what is left of the draft's
load) or engine.exact.optimize.Int4Draft (the int4 kernel's codes and that int8 copy; its output layer: the codes
alone). That saves the dequantizing and quantizing (14 s of the default draft's 25 s load on the 2-core Intel Xeon).
Beside a float32 target nothing is stored: the target's packing is the longer load there, and storing the draft did
not shorten the start.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

from engine.exact.grouped_int8 import GroupedInt4Linear, GroupedInt8Linear, GroupedQ4KLinear, GroupedQ6KLinear
from engine.exact.optimize import Int4Draft, dynamic_int8_shell
from engine.loading.gguf_load import GGUFEmbedding, _parent, _rebuild_meta_buffers, empty_model, meta_tensors
from engine.cache import cache_dir

log = logging.getLogger(__name__)

# a draft's Linear forms by their names in the stored file: (the type, an empty one of a shape for load_state_dict)
DRAFT_FORMS = {"dynamic-int8": (DynamicLinear, dynamic_int8_shell), "int4-draft": (Int4Draft, Int4Draft.shell)}

# bump when grouped_int8's layout or quantization changes: older files are then not read (4: the int4 target's draft
# keeps its output layer on the int4 kernel; a version 3 file, still readable, would give it torch's int8 one)
FORMAT = 4


def store_path(gguf: Path, precision: str = "int8") -> Path:
    return cache_dir() / precision / f"{gguf.stem}-{gguf.stat().st_size}-v{FORMAT}.pt"


def load_or_build(gguf: Path, meta_dir: Path, build: Callable[[], nn.Module], precision: str = "int8") -> nn.Module:
    """The int8 (or int4) target of `gguf` (`precision` "draft-int8" or "draft-int4": the draft): mapped (the draft:
    read) from its stored form, or built by `build` (the GGUF loader with the precision's converter) and stored."""
    path = store_path(gguf, precision)
    role = "draft" if precision.startswith("draft") else "target"
    if path.exists():
        try:
            return load_stored(path, meta_dir, mmap=role == "target")
        except Exception as e:  # noqa: BLE001 - a damaged or foreign file: build it again
            log.warning("the stored %s form %s does not load (%s): building it again", role, path, e)
            path.unlink(missing_ok=True)
    model = build()
    try:
        save(model, path)
    except OSError as e:  # a full or read-only cache: this start still runs, the next builds again
        log.warning("could not store the %s in %s (%s): the next start quantizes it again", role, path, e)
    return model


def save(model: nn.Module, path: Path) -> None:
    embeddings = {name: {"qtype": int(m.qtype), "dim": m.embedding_dim}
                  for name, m in model.named_modules() if isinstance(m, GGUFEmbedding)}
    int4 = [name for name, m in model.named_modules() if isinstance(m, GroupedInt4Linear)]
    int4_k = [name for name, m in model.named_modules() if isinstance(m, GroupedQ4KLinear)]
    int6_k = [name for name, m in model.named_modules() if isinstance(m, GroupedQ6KLinear)]
    form_names = {form: name for name, (form, _) in DRAFT_FORMS.items()}
    draft = {name: form_names[type(m)] for name, m in model.named_modules() if type(m) in form_names}
    path.parent.mkdir(parents=True, exist_ok=True)
    # a stopped save leaves no file that looks whole; two loads at once (two backends in one process) write two
    partial = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.partial")
    log.info("storing the running form in %s (read at the next start instead of computed)", path)
    try:
        torch.save({"state": model.state_dict(), "embeddings": embeddings, "int4": int4, "int4_k": int4_k,
                    "int6_k": int6_k, "draft": draft}, partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    remove_older_formats(path)


def remove_older_formats(path: Path) -> None:
    """Delete the same GGUF's stored files of older formats beside `path`: this checkout never reads them (an older one
    that shares the cache builds its own again); a newer format's file stays for the checkout that wrote it."""
    stem, _, version = path.name.rpartition("-v")
    if not stem or version != f"{FORMAT}.pt":
        return
    for older in path.parent.glob(f"{glob.escape(stem)}-v*.pt"):
        found = re.fullmatch(rf"{re.escape(stem)}-v(\d+)\.pt", older.name)
        if found and int(found.group(1)) < FORMAT:
            older.unlink(missing_ok=True)


def load_stored(path: Path, meta_dir: Path, mmap: bool = True) -> nn.Module:
    """The model stored at `path`: built empty from `meta_dir`'s config, its Linears as the file lists them, then
    filled from the file. `mmap`: False for a draft. fbgemm packs its int8 weights into memory of its own; mapped,
    the file's pages that the packing read would stay resident beside that copy (0.36 GiB more RSS for the default
    draft, measured 2026-12-03)."""
    from gguf import GGMLQuantizationType

    stored = torch.load(path, mmap=mmap, weights_only=True)
    state, int4, draft = stored["state"], set(stored.get("int4", ())), stored.get("draft", {})
    int4_k, int6_k = set(stored.get("int4_k", ())), set(stored.get("int6_k", ()))
    model = empty_model(meta_dir)
    for name, module in list(model.named_modules()):
        parent, attr = _parent(model, name) if name else (None, "")
        if isinstance(module, nn.Linear):
            shape = module.in_features, module.out_features, module.bias is not None
            if name in draft:
                _, form = DRAFT_FORMS[draft[name]]
            else:
                form = (GroupedQ4KLinear if name in int4_k else GroupedQ6KLinear if name in int6_k
                        else GroupedInt4Linear if name in int4 else GroupedInt8Linear).shell
            setattr(parent, attr, form(*shape))
        elif name in stored["embeddings"]:
            info = stored["embeddings"][name]  # its rows stay in the file's tensor (mapped, for a target)
            embedding = GGUFEmbedding(state[f"{name}.raw"], GGMLQuantizationType(info["qtype"]), info["dim"])
            setattr(parent, attr, embedding)
    model.load_state_dict(state, strict=True, assign=True)
    _rebuild_meta_buffers(model)
    missing = meta_tensors(model)
    if missing:
        raise ValueError(f"{path.name} lacks {missing[:5]}")
    log.info("%s %s from %s", "draft" if draft else "target", "mapped" if mmap else "read", path)
    return model.eval()
