"""llama.cpp engines the console starts: one llama.cpp server per engine, serving llama.cpp's HTTP API on 127.0.0.1.

Which llama.cpp serves (`ServerBuild`, chosen by `choose_build`):
- `llama-server` built here for this CPU (engine.llamacpp.native), the default wherever a compiler can build it;
- a `llama-server` binary of the user's own (--llamacpp-server PATH);
- else the `xllamacpp` wheel (llama.cpp's server prebuilt for AVX2 only), run in a Python process per engine:

    python -m engine.llamacpp.server --model T.gguf [--method draft --draft D.gguf --k 4] --threads 2 --ready FILE

A process per engine, not the server in the console's process: a llama.cpp abort (a failed GGML_ASSERT) ends only
that engine, which the backend then reports, and an engine can be stopped or restarted alone. Each runs under
engine/serving/server_guard.py, as a managed vLLM server does, so none outlives the console.

Option names changed across llama.cpp versions (--draft-max became --spec-draft-n-max, n-gram drafting gained types
of its own), and the wheel exposes them as attributes of its CommonParams: check_build() looks each one up in the
installed build before anything starts and names what is missing.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from engine.serving.guarded_process import GuardedProcess, healthy, server_env
from engine.limits import MAX_K
from engine.methods import parse_spec
from engine.serving.stream import ServerError

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]  # the project: engine/llamacpp/server.py

# --llamacpp-method -> (llama.cpp's speculative type, the CommonParamsSpeculative member that holds its settings).
# "draft" is llama-server's --spec-type draft-simple (-md), the others its --spec-type names.
METHODS = {
    "draft": ("DRAFT_SIMPLE", "draft"),
    "eagle3": ("DRAFT_EAGLE3", "draft"),
    "mtp": ("DRAFT_MTP", "draft"),
    "ngram-simple": ("NGRAM_SIMPLE", "ngram_simple"),
    "ngram-map-k": ("NGRAM_MAP_K", "ngram_map_k"),
    "ngram-map-k4v": ("NGRAM_MAP_K4V", "ngram_map_k4v"),
    "ngram-mod": ("NGRAM_MOD", "ngram_mod"),
    "ngram-cache": ("NGRAM_CACHE", "ngram_cache"),
}
DRAFT_MODEL_METHODS = ("draft", "eagle3")  # a second GGUF drafts (an EAGLE-3 head is a GGUF of its own)
# K: llama.cpp takes a draft n_max from 0 (no drafting) and an n-gram length up to 1024 (b11434's common/arg.cpp);
# at least one draft, and engine.limits caps it as for every backend
K_RANGE = (1, MAX_K)
BASE_OPTIONS = ("model.path", "n_ctx", "n_parallel", "port", "hostnames", "api_keys", "cpuparams.n_threads",
                "cpuparams_batch.n_threads", "speculative.types", "verbosity", "endpoint_metrics")
# the options each method's settings need; K is draft.n_max for the draft methods, the n-gram types' own length
METHOD_OPTIONS = {
    "draft": ("speculative.draft.mparams.path", "speculative.draft.n_max", "speculative.draft.n_min",
              "speculative.draft.p_min", "speculative.draft.cpuparams.n_threads",
              "speculative.draft.cpuparams_batch.n_threads"),
    "mtp": ("load_mtp", "speculative.draft.n_max", "speculative.draft.n_min", "speculative.draft.p_min"),
    "ngram_simple": ("speculative.ngram_simple.size_n", "speculative.ngram_simple.size_m"),
    "ngram_map_k": ("speculative.ngram_map_k.size_n", "speculative.ngram_map_k.size_m"),
    "ngram_map_k4v": ("speculative.ngram_map_k4v.size_n", "speculative.ngram_map_k4v.size_m"),
    "ngram_mod": ("speculative.ngram_mod.n_max", "speculative.ngram_mod.n_min", "speculative.ngram_mod.n_match"),
    "ngram_cache": (),
}
# --llamacpp-method -> llama-server's --spec-type
SPEC_TYPES = {"draft": "draft-simple", "eagle3": "draft-eagle3", "mtp": "draft-mtp", "ngram-simple": "ngram-simple",
              "ngram-map-k": "ngram-map-k", "ngram-map-k4v": "ngram-map-k4v", "ngram-mod": "ngram-mod",
              "ngram-cache": "ngram-cache"}
START_TIMEOUT_S = 300.0  # loading a GGUF takes seconds; a 1.5B model cold from disk well under a minute
STOP_TIMEOUT_S = 20.0


class LlamaCppError(ServerError):
    """A llama.cpp engine that cannot be configured, started, reached or trusted; the message says why."""


@dataclass(frozen=True)
class EngineConfig:
    """One llama.cpp engine: the target GGUF, and for a speculative one its method and drafting settings."""

    role: str  # "baseline" | "speculative" | "speculative-2" ...
    model: str  # the target's GGUF file
    method: str = "none"  # "none" or a key of METHODS
    draft: str | None = None  # the draft's GGUF (draft, eagle3)
    k: int | None = None  # drafts per step: draft.n_max, or the n-gram type's draft length; None: the build's
    n_min: int | None = None  # fewer drafts than this: the step runs without them
    p_min: float | None = None  # a draft model stops below this confidence
    ngram_n: int | None = None  # n-gram types: the length of the n-gram looked up (llama.cpp's default is 12)
    threads: int = 1
    ctx: int = 4096
    api_key: str | None = None
    parallel: int = 1  # requests served at once (llama-server --parallel; the context is split between them)

    def __post_init__(self):
        if self.k is not None and not K_RANGE[0] <= self.k <= K_RANGE[1]:
            raise LlamaCppError(f"K must be between {K_RANGE[0]} and {K_RANGE[1]}, got {self.k}")

    def label(self) -> str:
        """What the page calls this engine: "llama.cpp draft K=4"."""
        if self.method == "none":
            return "llama.cpp"
        extra = "".join(f" {name}={value}" for name, value in (("K", self.k), ("n_min", self.n_min),
                                                                ("p_min", self.p_min), ("N", self.ngram_n))
                        if value is not None)
        return f"llama.cpp {self.method}{extra}"

    def args(self) -> list[str]:
        """The command line of main() for this engine (the API key goes through the environment, never argv)."""
        out = ["--role", self.role, "--model", self.model, "--method", self.method, "--threads", str(self.threads),
               "--ctx", str(self.ctx), "--parallel", str(self.parallel)]
        for name in ("draft", "k", "n_min", "p_min", "ngram_n"):
            value = getattr(self, name)
            if value is not None:
                out += [f"--{name.replace('_', '-')}", str(value)]
        return out


def parse_method(spec: str, base: EngineConfig) -> EngineConfig:
    """`ngram-simple:k=4:n=3` or `draft:k=2:p_min=0.6` -> base with that method and settings (--llamacpp-compare)."""
    parsed = parse_spec(spec)
    if parsed.method not in METHODS:
        raise LlamaCppError(f"unknown llama.cpp method {parsed.method!r}; methods: {', '.join(METHODS)}")
    fields = {"k": "k", "n_min": "n_min", "p_min": "p_min", "n": "ngram_n"}

    def bad(option: str, _text: str) -> LlamaCppError:
        key, _, value = option.partition("=")
        if key in fields and value:
            return LlamaCppError(f"{spec!r}: {key} must be a number, got {value!r}")
        return LlamaCppError(f"{spec!r}: options are k=N, n_min=N, p_min=X and n=N (the n-gram length)")

    options = parsed.values({"k": int, "n_min": int, "p_min": float, "n": int}, bad)
    return replace(base, method=parsed.method, **{fields[key]: value for key, value in options})


# --- the build's option names ----------------------------------------------------------------------------------------


def check_build(config: EngineConfig) -> None:
    """LlamaCppError naming every option `config` needs that the installed xllamacpp build lacks (and the method's
    speculative type), so that a renamed option fails here, before any engine starts, and says which."""
    try:
        import xllamacpp
    except ImportError as e:
        raise LlamaCppError(f"the llama.cpp backend needs the xllamacpp package (`bash .ci/setup` installs it): {e}"
                            ) from e
    missing = [name for name in options_for(config) if not _has(xllamacpp.CommonParams(), name)]
    if config.method != "none":
        kind = "COMMON_SPECULATIVE_TYPE_" + METHODS[config.method][0]
        if not hasattr(xllamacpp.common_speculative_type, kind):
            missing.append(f"common_speculative_type.{kind}")
    if missing:
        raise LlamaCppError(f"this xllamacpp build ({getattr(xllamacpp, '__version__', '?')}) has no "
                            f"{', '.join(missing)}: llama.cpp renamed or dropped them. Install the version "
                            "pyproject.toml pins, or choose another --llamacpp-method.")


def options_for(config: EngineConfig) -> tuple[str, ...]:
    if config.method == "none":
        return BASE_OPTIONS
    if config.method not in METHODS:
        raise LlamaCppError(f"unknown llama.cpp method {config.method!r}; methods: {', '.join(METHODS)}")
    member = METHODS[config.method][1]
    names = METHOD_OPTIONS["mtp" if config.method == "mtp" else member]
    return BASE_OPTIONS + names


def _has(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return False
    return True


def build_params(config: EngineConfig, port: int = 0):
    """xllamacpp.CommonParams for `config` (check_build first). Sampling is the request's."""
    import xllamacpp

    check_build(config)
    if config.method in DRAFT_MODEL_METHODS and not config.draft:
        raise LlamaCppError(f"llama.cpp {config.method} drafting needs a draft GGUF (--draft)")
    p = xllamacpp.CommonParams()
    p.model.path = config.model
    p.n_ctx = config.ctx
    p.n_parallel = config.parallel
    p.hostnames = ["127.0.0.1"]
    p.port = port
    p.verbosity = 1
    p.endpoint_metrics = True  # /metrics: the server's own spec-decode counters, read beside each run's
    p.cpuparams.n_threads = config.threads
    p.cpuparams_batch.n_threads = config.threads
    if config.api_key:
        p.api_keys = [config.api_key]
    if config.method == "none":
        return p
    kind, member = METHODS[config.method]
    p.speculative.types = [getattr(xllamacpp.common_speculative_type, "COMMON_SPECULATIVE_TYPE_" + kind)]
    spec = p.speculative
    if member == "draft":
        draft = spec.draft
        if config.method == "mtp":
            p.load_mtp = True
        else:
            draft.mparams.path = config.draft
            draft.cpuparams.n_threads = config.threads
            draft.cpuparams_batch.n_threads = config.threads
        for name in ("n_min", "p_min"):
            if getattr(config, name) is not None:
                setattr(draft, name, getattr(config, name))
        if config.k is not None:
            draft.n_max = config.k
            draft.n_min = min(draft.n_min, config.k)
    elif member == "ngram_mod":
        mod = spec.ngram_mod
        if config.k is not None:
            mod.n_max = config.k
            mod.n_min = min(config.n_min if config.n_min is not None else mod.n_min, config.k)
        if config.ngram_n is not None:
            mod.n_match = config.ngram_n
    elif member != "ngram_cache":
        ngram = getattr(spec, member)
        if config.k is not None:
            ngram.size_m = config.k
        if config.ngram_n is not None:
            ngram.size_n = config.ngram_n
    return p


def server_args(config: EngineConfig) -> list[str]:
    """llama-server's command line for `config`, the same settings build_params gives the wheel (the API key goes
    through the environment, LLAMA_API_KEY, never argv)."""
    if config.method in DRAFT_MODEL_METHODS and not config.draft:
        raise LlamaCppError(f"llama.cpp {config.method} drafting needs a draft GGUF (--draft)")
    if config.method not in ("none", *METHODS):
        raise LlamaCppError(f"unknown llama.cpp method {config.method!r}; methods: {', '.join(METHODS)}")
    out = ["--model", config.model, "--ctx-size", str(config.ctx), "--parallel", str(config.parallel),
           "--host", "127.0.0.1", "--port", "0", "--threads", str(config.threads),
           "--threads-batch", str(config.threads), "--no-webui", "--metrics"]
    if config.method == "none":
        return out
    out += ["--spec-type", SPEC_TYPES[config.method]]
    member = METHODS[config.method][1]
    k, n_min = config.k, config.n_min
    if member == "draft":
        if config.method != "mtp":
            out += ["--spec-draft-model", config.draft, "--spec-draft-threads", str(config.threads),
                    "--spec-draft-threads-batch", str(config.threads)]
        if k is not None:
            out += ["--spec-draft-n-max", str(k)]
        if n_min is not None or k is not None:  # the wheel's path: n_min never above K
            out += ["--spec-draft-n-min", str(min(n_min if n_min is not None else 0, k if k is not None else 3))]
        if config.p_min is not None:
            out += ["--spec-draft-p-min", str(config.p_min)]
    elif member == "ngram_mod":
        if k is not None:
            out += ["--spec-ngram-mod-n-max", str(k), "--spec-ngram-mod-n-min",
                    str(min(n_min if n_min is not None else 48, k))]
        if config.ngram_n is not None:
            out += ["--spec-ngram-mod-n-match", str(config.ngram_n)]
    elif member != "ngram_cache":
        option = "--spec-" + member.replace("_", "-")  # --spec-ngram-simple, --spec-ngram-map-k, ...
        if k is not None:
            out += [f"{option}-size-m", str(k)]
        if config.ngram_n is not None:
            out += [f"{option}-size-n", str(config.ngram_n)]
    return out


# --- which llama.cpp serves -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerBuild:
    """The llama.cpp that serves the managed engines: a llama-server binary, or (binary None) the xllamacpp wheel."""
    binary: str | None
    description: str  # for the page's status line and the log: which build, with which CPU features, and why

    @property
    def wheel(self) -> bool:
        return self.binary is None


WHEEL = "the xllamacpp wheel (llama.cpp prebuilt for AVX2 only)"
VERSION_CHARS = 160
TRANSPARENT_HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def choose_build(choice: str = "auto", on_progress=None, model: str | None = None) -> ServerBuild:
    """--llamacpp-server: "auto" (llama-server built here for this CPU, building it first if needed and trying a new
    build on the GGUF file `model`; the wheel where no build is possible, saying why), "wheel", or the path of a
    llama-server binary of the user's own. Its description also says whether llama.cpp gets huge pages here."""
    build = _build(choice, on_progress, model)
    return replace(build, description=build.description + huge_pages_note())


def _build(choice: str, on_progress, model: str | None) -> ServerBuild:
    from engine.llamacpp import native

    if choice == "wheel":
        return ServerBuild(None, WHEEL + ", as --llamacpp-server wheel asks")
    if choice != "auto":
        return ServerBuild(choice, f"llama-server at {choice} ({binary_version(choice)})")
    try:
        build = native.ensure_built(on_progress=on_progress, model=model)
    except native.BuildError as e:
        log.warning("llama.cpp cannot be built for this CPU here, the wheel serves instead: %s", e)
        return ServerBuild(None, f"{WHEEL}: no build for this CPU here ({str(e).splitlines()[0]})")
    return ServerBuild(build.binary, build.describe())


def huge_pages_note(path: Path = TRANSPARENT_HUGE_PAGES) -> str:
    """Whether llama.cpp's memory is in huge pages here. It asks for none, so its repacked weights and buffers get them
    only where the system's transparent huge pages are `always`: on our Intel Xeon that decoded 1.13-1.20x faster
    than `madvise` (docs/llamacpp.md). "" where the setting cannot be read."""
    try:
        setting = re.search(r"\[(\w+)\]", path.read_text()).group(1)
    except (OSError, AttributeError):
        return ""
    return f"; transparent huge pages {setting}: llama.cpp runs {'in' if setting == 'always' else 'without'} them"


def binary_version(binary: str) -> str:
    """The first line of `binary --version` ("version: 11434 (...)"), at most VERSION_CHARS long (it goes into the
    status line); LlamaCppError if it does not run."""
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise LlamaCppError(f"--llamacpp-server {binary}: cannot run it: {e}") from e
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
    if done.returncode != 0 or not lines:
        raise LlamaCppError(f"--llamacpp-server {binary} is not a llama-server: `--version` answered "
                            f"{(done.stdout + done.stderr)[-200:]!r}")
    return lines[0][:VERSION_CHARS]


# --- one engine in a process of its own ------------------------------------------------------------------------------


LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


class LlamaCppEngine(GuardedProcess):
    """One engine process (under its guard) with its log file; start() returns once it answers /health, or raises
    with the log's tail."""

    def __init__(self, config: EngineConfig, log_dir: Path, python: str = sys.executable,
                 build: ServerBuild = ServerBuild(None, WHEEL)):
        super().__init__(f"{config.role} llama.cpp engine", log_dir / f"llamacpp-{config.role}.log", LlamaCppError)
        self.config, self.python, self.build = config, python, build
        self.ready_path = log_dir / f"llamacpp-{config.role}.url"
        self.url: str | None = None

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        env = server_env(dict(os.environ))
        self.url = None
        if self.build.wheel:
            check_build(self.config)
            self.ready_path.unlink(missing_ok=True)
            command = [self.python, "-m", "engine.llamacpp.server", *self.config.args(), "--ready",
                       str(self.ready_path)]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
            if self.config.api_key:
                env["SPECCONSOLE_LLAMACPP_KEY"] = self.config.api_key
        else:
            command = [self.build.binary, *server_args(self.config)]
            env.pop("LLAMA_API_KEY", None)
            if self.config.api_key:
                env["LLAMA_API_KEY"] = self.config.api_key
        log.info("starting the %s llama.cpp engine: %s", self.config.role, " ".join(command))
        self.spawn(command, env, python=self.python, cwd=ROOT)
        self.wait_ready(self._answers, timeout, poll_s=0.2)
        log.info("%s llama.cpp engine ready at %s", self.config.role, self.url)

    def _answers(self) -> bool:
        if self.url is None:
            self.url = self._listening()
        return self.url is not None and healthy(self.url)

    def _listening(self) -> str | None:
        """The URL the engine listens on: the wheel's process writes it to a file; llama-server, given port 0, says
        "listening on http://127.0.0.1:PORT" in its log."""
        if self.build.wheel:
            return self.ready_path.read_text().strip() if self.ready_path.exists() else None
        found = LISTENING.search(self.log_tail(200))
        return found.group(1) if found else None

    def stop(self) -> None:
        """Ask the guard to stop the engine; kill the whole group if it hangs. Safe to call twice."""
        super().stop(grace=STOP_TIMEOUT_S + 5)


# --- the engine process itself ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Serve one engine until SIGTERM / SIGINT; write its URL to --ready once it answers."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s llamacpp: %(message)s")
    p = argparse.ArgumentParser(prog="python -m engine.llamacpp.server", description=__doc__)
    p.add_argument("--role", default="engine")
    p.add_argument("--model", required=True, help="the target GGUF")
    p.add_argument("--method", default="none", choices=["none", *METHODS])
    p.add_argument("--draft", help="the draft GGUF (draft, eagle3)")
    p.add_argument("--k", type=int)
    p.add_argument("--n-min", type=int)
    p.add_argument("--p-min", type=float)
    p.add_argument("--ngram-n", type=int)
    p.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--parallel", type=int, default=1, help="requests served at once")
    p.add_argument("--port", type=int, default=0, help="0: any free port (the URL goes to --ready)")
    p.add_argument("--ready", help="file to write the URL to once the engine answers")
    a = p.parse_args(argv)
    config = EngineConfig(a.role, a.model, a.method, a.draft, a.k, a.n_min, a.p_min, a.ngram_n, a.threads, a.ctx,
                          os.environ.get("SPECCONSOLE_LLAMACPP_KEY") or None, a.parallel)
    import xllamacpp

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    server = xllamacpp.Server(build_params(config, a.port))
    url = server.listening_address
    url = url if url.startswith("http") else f"http://{url}"
    log.info("%s engine (%s) serving at %s", config.role, config.label(), url)
    if a.ready:
        tmp = Path(a.ready + ".tmp")
        tmp.write_text(url)
        tmp.replace(a.ready)  # whole or not at all: the console polls for it
    while not stop.wait(0.5):
        pass
    del server  # its destructor stops llama.cpp's loop and HTTP server
    return 0


if __name__ == "__main__":
    sys.exit(main())
