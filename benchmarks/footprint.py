"""Memory, disk and start-up time of a preset, each load in a fresh subprocess.

    python benchmarks/footprint.py                  # qwen-coder, from the cache as it is
    python benchmarks/footprint.py --cold           # also a start from the downloaded wheels only (no download:
                                                    # the cache's wheels are hard-linked into a scratch cache)
    python benchmarks/footprint.py --code /tmp/old  # the same measurement for another checkout (before/after)
    python benchmarks/footprint.py --precision float16   # the target in float16 or int8 (engine.exact.precision)

Figures: RSS and USS (psutil memory_full_info) once loaded and after a short greedy run on both engines; peak RSS
(getrusage ru_maxrss) and peak USS (sampled every 0.1 s); seconds from process start (imports included) to a
LocalBackend that can serve, and from `python launch.py` to the console's "Ready" (with the RSS of the console's
process and of its engine process then); the preset's files in the cache. Timings on a shared machine are noisy;
memory is not.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
log = logging.getLogger("footprint")


def child(preset_name: str, precision: str) -> None:
    """Runs in the fresh process: load, measure, one greedy run on both engines, measure again, print JSON."""
    import gc
    import resource

    import psutil

    proc = psutil.Process()
    peak = {"uss": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            try:
                peak["uss"] = max(peak["uss"], proc.memory_full_info().uss)
            except psutil.Error:
                pass
            done.wait(0.1)

    threading.Thread(target=sample, daemon=True).start()
    try:
        from engine.setup import setup
    except ImportError:  # a checkout (--code) from before engine.setup: importing its engine made the settings
        pass
    else:
        setup()
    from engine.exact.backend import LocalBackend
    from engine.request import Request

    # the float32 default is not named, so that a checkout from before --precision (--code) still loads
    backend = LocalBackend.from_preset(preset_name, **({} if precision == "float32" else {"precision": precision}))
    ready_s = time.time() - proc.create_time()
    gc.collect()
    loaded = proc.memory_full_info()
    drafting = {"method": "draft" if backend.draft else "ngram", "k": 4}
    try:
        from engine.drafting import Drafting
    except ImportError:  # a checkout (--code) from before engine.drafting: the drafting settings are Request's own
        req = Request(prompt="Write a Python function that reverses a string.", max_new_tokens=8, **drafting)
    else:
        req = Request(prompt="Write a Python function that reverses a string.", max_new_tokens=8,
                      drafting=Drafting(**drafting))
    *_, base = backend.baseline(req)
    *_, spec = backend.speculative(req)
    gc.collect()
    after = proc.memory_full_info()
    done.set()
    print(json.dumps({
        "ready_s": round(ready_s, 1),
        "loaded_rss_gib": loaded.rss / GIB, "loaded_uss_gib": loaded.uss / GIB,
        "steady_rss_gib": after.rss / GIB, "steady_uss_gib": after.uss / GIB,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
        "peak_uss_gib": max(peak["uss"], after.uss) / GIB,
        "weights_gib": (backend.target.nbytes + (backend.draft.nbytes if backend.draft else 0)) / GIB,
        "greedy_identical": base.output_ids == spec.output_ids,
    }))


def measure(preset: str, cache: Path, code: Path, precision: str) -> dict:
    env = dict(os.environ, SPECCONSOLE_CACHE=str(cache), HF_HUB_OFFLINE="1", PYTHONPATH=str(code),
               GRADIO_ANALYTICS_ENABLED="False", TQDM_DISABLE="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", preset, "--precision", precision]
    done = subprocess.run(cmd, env=env, cwd=code, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the load failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def console_start(preset: str, cache: Path, code: Path, precision: str) -> dict:
    """Seconds from `python launch.py` to the console's "Ready" (its loader's log line; the page polls the same
    state), gradio and the page included, and the RSS of the console's process and of its engine process then. The
    page must answer too."""
    import socket
    import urllib.request

    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, SPECCONSOLE_CACHE=str(cache), HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
               TQDM_DISABLE="1")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(code / "launch.py"), "--preset", preset, "--port", str(port),
               "--db", str(Path(tmp) / "history.db"), "--precision", precision]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=code, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        try:
            for line in proc.stderr:
                if "models ready" in line:
                    ready = time.monotonic() - start
                    console = psutil.Process(proc.pid)
                    engines = sum(p.memory_info().rss for p in console.children(recursive=True))
                    out = {"console_ready_s": round(ready, 1), "console_rss_gib": console.memory_info().rss / GIB,
                           "engine_process_rss_gib": engines / GIB}
                    break
                if "loading the models failed" in line or "Traceback" in line:
                    raise SystemExit(f"the console failed to load: {line.strip()}")
            else:
                raise SystemExit(f"the console ended before it was ready (exit {proc.wait()})")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as page:
                assert page.status == 200
        finally:
            proc.terminate()
            proc.wait(60)
    return out


STORED = {"int8": "int8 (the int8 target's stored form)", "int4": "int4 (the int4 target's stored form)",
          "draft-int8": "draft-int8 (the int8 draft's stored form)",
          "draft-int4": "draft-int4 (the draft's stored form beside an int4 target)"}


def preset_files(preset: str, cache: Path) -> dict[str, int]:
    """Bytes on disk per kind of file the preset uses (hard links counted once per path, as du would)."""
    from engine.presets import PRESETS
    from engine.loading.weights import SOURCES

    p = PRESETS[preset]
    sizes = {"gguf": 0, "gguf-meta": 0, **dict.fromkeys(STORED.values(), 0), "wheels": 0,
             "legacy float32 (models/)": 0}
    for name in filter(None, (p.target, p.draft)):
        source = SOURCES[name]
        files = {"gguf": [cache / "gguf" / source.filename], "gguf-meta": (cache / "gguf-meta" / name).glob("*"),
                 **{kind: (cache / precision).glob(f"{Path(source.filename).stem}-*.pt")
                    for precision, kind in STORED.items()},
                 "legacy float32 (models/)": (cache / "models" / name).glob("*"),
                 "wheels": [w for c in source.chunks for w in (cache / "wheels").glob(f"{c.dist.replace('-', '_')}-*.whl")]}
        for kind, paths in files.items():
            sizes[kind] += sum(f.stat().st_size for f in paths if f.is_file())
    return sizes


def machine() -> str:
    import psutil

    from engine.cpu import cpu

    return (f"{cpu().model}, {os.cpu_count()} cores, {psutil.virtual_memory().total / GIB:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}, load average {os.getloadavg()[0]:.1f} at start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen-coder")
    ap.add_argument("--cold", action="store_true", help="also measure a start from the wheels only")
    ap.add_argument("--code", type=Path, default=ROOT, help="checkout whose engine is measured")
    ap.add_argument("--precision", default="float32", choices=("float32", "float16", *STORED),
                    help="the target's weights")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        logging.basicConfig(level=logging.WARNING)
        return child(args.child, args.precision)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.path.insert(0, str(ROOT))
    from engine.cache import cache_dir
    from engine.loading.weights import SOURCES

    cache = cache_dir()
    log.info("machine: %s", machine())
    log.info("code: %s; cache: %s; target precision: %s", args.code, cache, args.precision)
    runs = {}
    if args.cold:
        from engine.presets import PRESETS

        p = PRESETS[args.preset]
        with tempfile.TemporaryDirectory(dir=cache, prefix="cold-") as scratch:
            (Path(scratch) / "wheels").mkdir()
            for name in filter(None, (p.target, p.draft)):
                for c in SOURCES[name].chunks:
                    for wheel in (cache / "wheels").glob(f"{c.dist.replace('-', '_')}-{c.version}-*.whl"):
                        os.link(wheel, Path(scratch) / "wheels" / wheel.name)
            log.info("cold start (wheels only; assembles, reads configs, loads)...")
            runs["cold"] = measure(args.preset, Path(scratch), args.code, args.precision)
            runs["cold"]["cache_after"] = preset_files(args.preset, Path(scratch))
    log.info("cached start...")
    runs["cached"] = measure(args.preset, cache, args.code, args.precision)
    log.info("cached start of the console...")
    runs["cached"] |= console_start(args.preset, cache, args.code, args.precision)
    files = preset_files(args.preset, cache)
    for kind, r in runs.items():
        log.info("%s start: ready in %.1f s (process start to a backend that can serve, imports included)",
                 kind, r["ready_s"])
        if "console_ready_s" in r:
            log.info("  the console (python launch.py): \"Ready\" after %.1f s; then RSS %.2f GiB, its engine "
                     "process %.2f GiB", r["console_ready_s"], r["console_rss_gib"], r["engine_process_rss_gib"])
        log.info("  loaded: RSS %.2f GiB, USS %.2f GiB; after an 8-token run on both engines: RSS %.2f GiB, "
                 "USS %.2f GiB", r["loaded_rss_gib"], r["loaded_uss_gib"], r["steady_rss_gib"], r["steady_uss_gib"])
        log.info("  peak: RSS %.2f GiB (ru_maxrss), USS %.2f GiB (sampled); weights as counted by the engine "
                 "%.2f GiB; greedy speculative == baseline: %s", r["peak_rss_gib"], r["peak_uss_gib"],
                 r["weights_gib"], r["greedy_identical"])
    for kind, n in files.items():
        log.info("cache, %s: %.2f GB", kind, n / 1e9)
    stored = files.get(STORED.get(args.precision), 0)
    used = files["gguf"] + files["gguf-meta"] + stored
    log.info("cache the preset needs (gguf + gguf-meta%s): %.2f GB; all of the above: %.2f GB",
             f" + {args.precision}" if args.precision in STORED else "", used / 1e9, sum(files.values()) / 1e9)
    print(json.dumps({"machine": machine(), "runs": runs, "cache_bytes": files}, indent=1))


if __name__ == "__main__":
    main()
