"""Load a model straight from its GGUF file, one tensor at a time, into the form it runs in.

Why: the float32 safetensors cache held every weight twice in the console process (the mapped float32 file beside
the oneDNN-packed copy) and took 9 GB of disk for a 1.6 GB download. Here the model is built on the meta device,
each GGUF tensor is dequantized (engine.loading.gguf_dequant: bitwise the values of gguf's numpy code, which transformers
calls, so the float32 values are those of the old cache) and handed to `convert`, which packs or quantizes a
Linear as soon as its tensors are in; the float32 tensor is then dropped. Peak memory is the model plus one layer.

The input embedding is only ever indexed, so it stays in its GGUF block format (`GGUFEmbedding`): rows are
dequantized when looked up, bitwise equal to the rows of the full dequantization (GGUF blocks never span rows).
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from engine.loading.gguf_dequant import SixBitTerms, dequantize, four_bit_groups, six_bit_terms

log = logging.getLogger(__name__)

Convert = Callable[[nn.Linear], nn.Module]  # a complete float32 Linear -> what the model runs (packed, int8, itself)
# the same, for a Linear whose weight is a Q4_K, Q4_1 or Q6_K tensor, with that tensor's own codes and scales
OwnCodesConvert = Callable[[nn.Linear, tuple[torch.Tensor, ...]], nn.Module]


class GGUFEmbedding(nn.Module):
    """nn.Embedding over GGUF-quantized rows: ~1/6 of the float32 matrix for Q4_K, the same values when looked up."""

    def __init__(self, raw: torch.Tensor, qtype, dim: int):
        super().__init__()
        self.qtype, self.embedding_dim = qtype, dim
        self.num_embeddings = raw.shape[0]
        self.register_buffer("raw", raw)  # [V, bytes per row] uint8

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.raw[ids.reshape(-1).cpu()].numpy()
        out = torch.from_numpy(dequantize(rows, self.qtype)).reshape(*ids.shape, self.embedding_dim)
        return out.to(ids.device)


def tensor_index(gguf: Path, meta_dir: Path) -> dict:
    """Architecture and tensor table (name, type, shape, offset) of a GGUF file, cached beside its config:
    GGUFReader parses every metadata field, 150k-token vocabularies included, which costs seconds per start."""
    path = meta_dir / "tensors.json"
    st = gguf.stat()
    if path.exists():
        index = json.loads(path.read_text())
        if index.get("size") == st.st_size:
            return index
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    tensors = [{"name": t.name, "type": int(t.tensor_type), "dims": [int(d) for d in t.shape],
                "dtype": t.data.dtype.str, "shape": list(t.data.shape), "offset": int(t.data_offset),
                "nbytes": int(t.data.nbytes)} for t in reader.tensors]
    index = {"version": 1, "size": st.st_size, "arch": arch, "tensors": tensors}
    path.write_text(json.dumps(index))
    return index


def _name_map(model: nn.Module, arch_name: str, layers: int) -> dict[str, str]:
    """GGUF tensor name -> parameter name (what transformers' get_gguf_hf_weights_map finds, with one name table
    instead of one per submodule, which took seconds)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch_name)
    table = get_tensor_name_map(arch, layers)
    names = {}
    for hf in model.state_dict(keep_vars=True):
        base, _, suffix = hf.rpartition(".")
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            names.setdefault(f"{gguf_name}.{suffix}", hf)
    return names


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def _complete(module: nn.Module) -> bool:
    return not any(t.is_meta for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)))


def load_gguf_model(
    gguf: Path, meta_dir: Path, convert: Convert, embed_quantized: bool = True,
    on_progress: Callable[[str, float, float], None] | None = None, own_codes: OwnCodesConvert | None = None,
) -> nn.Module:
    """A transformers causal LM (config from `meta_dir`) with its weights from `gguf`, Linears passed to `convert`.
    `own_codes`: where given, a Linear whose weight is a Q4_K, Q4_1 or Q6_K tensor is passed to it instead, with that
    tensor's own codes and scales (gguf_dequant.four_bit_groups, six_bit_terms), for the int4 target's converter."""
    from gguf import GGMLQuantizationType
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    model = empty_model(meta_dir)
    config = model.config
    index = tensor_index(gguf, meta_dir)
    processor = TENSOR_PROCESSORS.get(index["arch"], TensorProcessor)(config=config.to_dict())  # reads head counts
    names = _name_map(model, index["arch"], config.num_hidden_layers)
    embed_name = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    tied = bool(getattr(config, "tie_word_embeddings", False))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    head_name = next((n for n, m in linears.items() if m is model.get_output_embeddings()), None)
    file = np.memmap(gguf, dtype=np.uint8, mode="r")

    groups: dict[str, tuple[torch.Tensor, ...]] = {}  # a Linear's own codes and scales, for own_codes

    def finish_linear(name: str, weight: torch.Tensor | None = None) -> None:
        linear = linears.pop(name)
        if weight is not None:
            linear.weight = nn.Parameter(weight, requires_grad=False)
        if _complete(linear):
            parent, attr = _parent(model, name)
            own = groups.pop(name, None)
            setattr(parent, attr, convert(linear) if own is None else own_codes(linear, own))
        else:
            linears[name] = linear

    def data(entry) -> np.ndarray:  # the tensor's bytes as GGUFReader would give them, a view of the mapped file
        raw = file[entry["offset"]: entry["offset"] + entry["nbytes"]]
        return raw.view(np.dtype(entry["dtype"])).reshape(entry["shape"])

    def processed(values: np.ndarray, entry) -> torch.Tensor:  # as transformers reorders it (llama's q and k rows)
        values = processor.process(weights=values, name=entry["name"], tensor_key_mapping=names,
                                   parsed_parameters={}).weights
        return torch.from_numpy(np.ascontiguousarray(values))

    def to_float(entry) -> torch.Tensor:
        return processed(dequantize(data(entry), entry["type"]), entry)  # dequantize's own memory: nothing stays mapped

    def groups_of(entry) -> tuple[torch.Tensor, ...] | None:  # a tensor's own codes and scales, in row order
        if (six := six_bit_terms(data(entry), entry["type"])) is not None:
            return SixBitTerms(*(processed(t.numpy(), entry) for t in six))
        groups = four_bit_groups(data(entry), entry["type"])
        return None if groups is None else tuple(processed(t.numpy(), entry) for t in groups)

    def kept_quantized(entry) -> bool:
        quantized = entry["type"] not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        return names[entry["name"]].rpartition(".")[0] == embed_name and embed_quantized and quantized

    # dequantize the next tensor in a thread while this one is packed (both release the GIL); one ahead at most,
    # so that memory holds one extra tensor
    todo = [e for e in index["tensors"] if e["name"] in names and not (kept_quantized(e) and not tied)]
    pool, pending = ThreadPoolExecutor(1, thread_name_prefix="dequantize"), {}

    def dequantized(entry) -> torch.Tensor:
        while todo and len(pending) < 2:
            ahead = todo.pop(0)
            pending[ahead["name"]] = pool.submit(to_float, ahead)
        return pending.pop(entry["name"]).result()

    desc = f"loading {gguf.name}"
    bar = tqdm(index["tensors"], desc=desc, unit="tensor")
    for i, entry in enumerate(bar):
        hf = names.get(entry["name"])
        if hf is None:
            log.debug("skipping GGUF tensor %s (no parameter of %s)", entry["name"], type(model).__name__)
            continue
        module_name, _, attr = hf.rpartition(".")
        if kept_quantized(entry):
            parent, pattr = _parent(model, module_name)
            qtype = GGMLQuantizationType(entry["type"])
            rows = torch.from_numpy(np.array(data(entry), copy=True))  # a copy: the file can be unmapped
            setattr(parent, pattr, GGUFEmbedding(rows, qtype, int(entry["dims"][0])))
            if tied and head_name in linears:  # the tied head is the one float32 copy of the matrix
                finish_linear(head_name, dequantized(entry))
        elif module_name in linears:
            if own_codes is not None and attr == "weight" and (own := groups_of(entry)) is not None:
                groups[module_name] = own
            setattr(linears[module_name], attr, nn.Parameter(dequantized(entry), requires_grad=False))
            finish_linear(module_name)
        else:
            module = model.get_submodule(module_name)
            setattr(module, attr, nn.Parameter(dequantized(entry), requires_grad=False))
            if tied and module_name == embed_name and head_name in linears:
                finish_linear(head_name, module.weight)
        if on_progress:
            on_progress(desc, i + 1, len(index["tensors"]))
    bar.close()
    pool.shutdown()
    del file
    _rebuild_meta_buffers(model)
    missing = meta_tensors(model)
    if missing or linears:
        raise ValueError(f"{gguf.name} lacks tensors for {sorted(set(missing) | set(linears))[:5]}")
    return model.eval()


def empty_model(meta_dir: Path) -> nn.Module:
    """The causal LM of `meta_dir`'s config and generation config, its tensors on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(meta_dir), dtype=torch.float32)
    model.generation_config = GenerationConfig.from_pretrained(meta_dir)
    return model


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of the parameters and buffers that no weight has filled yet."""
    return [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]


def _rebuild_meta_buffers(model: nn.Module) -> None:
    """Non-persistent buffers computed at init (rotary inverse frequencies) stayed on meta: build those modules anew."""
    for name, module in list(model.named_modules()):
        if name and any(b.is_meta for b in module.buffers(recurse=False)) and not isinstance(module, GGUFEmbedding):
            parent, attr = _parent(model, name)
            setattr(parent, attr, type(module)(config=model.config))
