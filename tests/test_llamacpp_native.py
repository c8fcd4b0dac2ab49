"""llama-server built here for this CPU (engine.llamacpp.native): the probe, the build the managed engines run, what
it was built with, the user's own binary, the wheel where no build is possible, a killed build, and the server's own
spec-decode counters (/metrics) beside a run's count. The build itself
is made once per machine (`.ci/setup test` makes it; here ensure_built() finds it in the cache)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.page import console_servers
from engine.events import TokenEvent
from engine.llamacpp import native
from engine.llamacpp import server as llamacpp_server
from engine.llamacpp.backend import LlamaCppBackend
from engine.llamacpp.server import (WHEEL, EngineConfig, LlamaCppEngine, LlamaCppError, ServerBuild,
                                    choose_build, huge_pages_note, parse_method, server_args)
from engine.loading.weights import gguf_model
from engine.request import Request
from engine.serving.counters import counters_delta

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smol() -> str:
    return str(gguf_model("smollm2-135m-instruct")[0])


@pytest.fixture(scope="module")
def build(smol) -> native.Build:
    return native.ensure_built(model=smol)


def test_the_probe_runs_each_instruction_set_and_reports_what_faults():
    verdicts = native.probe()
    assert set(verdicts) == {f.name for f in native.FEATURES}
    assert verdicts["AVX2"] == "runs"  # every machine kind of ours has it
    flags = Path("/proc/cpuinfo").read_text().split()
    if "amx_tile" not in flags:  # AMD: the instruction is not there at all
        assert verdicts["AMX_TILE"].startswith("faults")
    if "avx512f" in flags:
        assert verdicts["AVX512"] == "runs"


def test_the_build_has_what_runs_here_and_nothing_that_faults(build, smol):
    """llama-server's own system info (logged at its highest verbosity as it loads a model) names exactly the sets
    the probe saw run, less those with which a build of llama.cpp's died (the probe's record keeps both)."""
    verdicts = native.probed(native.compiler())
    assert {n: v for n, v in native.probe().items() if v != "runs"}.items() <= verdicts.items()
    assert build.features == [name for name, verdict in verdicts.items() if verdict == "runs"]
    assert set(build.left_out) == {name for name, verdict in verdicts.items() if verdict != "runs"}
    command = [build.binary, "--model", smol, "--host", "127.0.0.1", "--port", "0", "--threads", "1", "--log-verbose"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                          start_new_session=True) as proc:
        deadline = threading.Timer(120, proc.kill)  # a server that never says it ends the wait
        deadline.start()
        try:
            line = next((line for line in proc.stdout if "system_info:" in line), "")
        finally:
            deadline.cancel()
            proc.kill()
    printed = {name for name, on in re.findall(r"\b([A-Z0-9_]+) = (\d)", line) if on == "1"}
    named = {f.name for f in native.FEATURES} - {"AMX_TILE", "AMX_BF16"}  # the sets llama.cpp's system info names
    assert "AVX2" in printed and printed & named == set(build.features) & named, line


def test_the_managed_engines_run_this_build_and_say_so(build, smol, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="engine.llamacpp.server")
    chosen = choose_build("auto")
    assert chosen.binary == build.binary and "built here for" in chosen.description
    assert chosen.description.endswith(huge_pages_note()) and "transparent huge pages" in chosen.description
    config = EngineConfig("speculative", smol, "draft", draft=smol, k=4, threads=1)
    args = server_args(config)
    assert args[args.index("--spec-type") + 1] == "draft-simple" and args[args.index("--spec-draft-n-max") + 1] == "4"
    assert args[args.index("--spec-draft-model") + 1] == smol and args[args.index("--host") + 1] == "127.0.0.1"
    backend = LlamaCppBackend.managed(config, log_dir=tmp_path, build=chosen)
    try:
        assert all(Path(e.build.binary or "").samefile(build.binary) for e in backend.servers)
        req = Request(prompt="Repeat exactly: alpha beta gamma delta, alpha beta gamma delta", max_new_tokens=24)
        plain = list(backend.baseline(req))[-1]
        spec = list(backend.speculative(req))[-1]
        assert [t.token_id for t in spec.tokens] == [t.token_id for t in plain.tokens]
        assert spec.metrics.drafted > 0  # llama-server really drafted (with its draft model, K=4)
        # benchmarks.page attaches its API to the servers a console started, read from the console's log
        assert console_servers(caplog.text) == [backend.urls["baseline"], backend.urls["speculative"]]
    finally:
        backend.close()
    assert not any(e.alive() for e in backend.servers)


REPEAT = "Repeat exactly: alpha beta gamma delta, alpha beta gamma delta"


def test_the_servers_own_counters_agree_with_the_run(build, smol, tmp_path):
    """A managed llama-server runs with --metrics: its counters grew by the run's own count. They grow once, as the
    request ends (never mid-run), and a reading right after the stream holds the whole run. A stop inside a pass
    leaves accepted drafts that the server counts and the output never shows: said, not flagged."""
    backend = LlamaCppBackend.managed(EngineConfig("speculative", smol, "draft", draft=smol, k=4, threads=1),
                                      log_dir=tmp_path, build=ServerBuild(build.binary, "built here"))
    try:
        before, mid, events = backend.scrape("speculative"), None, []
        for event in backend.speculative(Request(prompt=REPEAT, max_new_tokens=48)):
            events.append(event)
            if isinstance(event, TokenEvent) and len(events) == 3:
                mid = backend.scrape("speculative")
        after = backend.scrape("speculative")
        m = events[-1].metrics
        assert events[-1].error is None and m.highlighting.startswith("exact") and m.steps > 1
        c = m.server_counters
        assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (m.steps, m.drafted, m.accepted)
        assert c.mismatch is None and c.expected_difference is None and len(c.per_position_acceptance) == 4
        grew = counters_delta(before, after)
        assert (grew["num_drafts"], grew["num_draft_tokens"], grew["num_accepted_tokens"]) == (
            c.drafts, c.draft_tokens, c.accepted_tokens)  # nothing counted after the run's own reading
        assert mid in (before, after)  # all at once: none of the run's passes counted on its own

        # a stop string on an accepted draft of a pass that accepted more: the output ends inside that pass
        step = next(s for s in events[-1].steps if s.accepted >= 2)
        tokens = events[-1].tokens
        first = next(t for t in tokens if t.step == step.step)
        stop = first.text.strip()
        assert stop and stop not in "".join(t.text for t in tokens[:first.index])
        stopped = list(backend.speculative(Request(prompt=REPEAT, max_new_tokens=48, stop_strings=(stop,))))[-1]
        m = stopped.metrics
        assert stopped.finish_reason == "stop" and m.highlighting.startswith("exact")
        cut = m.server["accepted"] - m.accepted
        assert cut >= 1 and m.server_counters.accepted_tokens == m.server["accepted"]
        assert m.server_counters.mismatch is None
        assert f"a stop ended the output inside the last step, and the server also counts the {cut} " in \
            m.server_counters.expected_difference
    finally:
        backend.close()


def test_an_attached_server_without_metrics_leaves_the_counters_unknown(build, smol, tmp_path, monkeypatch, caplog):
    """llama-server started without --metrics answers /metrics with 501: the counters are unknown, said once in the
    log (not per run), and the runs go on."""
    monkeypatch.setattr(llamacpp_server, "server_args",
                        lambda config, args=server_args: [a for a in args(config) if a != "--metrics"])
    engines = [LlamaCppEngine(EngineConfig(role, smol, method, k=4, ngram_n=2, threads=1), tmp_path,
                              build=ServerBuild(build.binary, "built here"))
               for role, method in (("baseline", "none"), ("speculative", "ngram-simple"))]
    try:
        for engine in engines:
            engine.start()
        backend = LlamaCppBackend.attach([e.url for e in engines])
        req = Request(prompt=REPEAT, max_new_tokens=24)
        runs = [list(backend.speculative(req))[-1] for _ in range(2)]
        assert all(r.error is None and r.metrics.server_counters is None for r in runs)
        assert runs[0].metrics.server["drafted"] > 0  # it speculated, and the run's own count stands
        said = [r.getMessage() for r in caplog.records if "/metrics" in r.getMessage()]
        assert len(said) == 1 and "answered 501" in said[0] and "--metrics" in said[0], said
    finally:
        for engine in engines:
            engine.stop()


def test_a_users_own_binary_is_run_and_named(build, smol, tmp_path, monkeypatch):
    from engine.llamacpp import server
    from specconsole.backends import llamacpp_host

    asked = []  # its --version is read once, when the options are checked, not again when the engines start
    monkeypatch.setattr(server, "binary_version", lambda binary, read=server.binary_version: asked.append(binary)
                        or read(binary))

    args = Namespace(llamacpp_attach=None, llamacpp_api_key_env="X", preset="smollm2-ngram", target=None,
                     draft=None, llamacpp_method="ngram-simple", llamacpp_k=4, llamacpp_n_min=None,
                     llamacpp_p_min=None, llamacpp_ngram_n=2, llamacpp_threads=1, llamacpp_compare=None,
                     llamacpp_server=build.binary)
    host = llamacpp_host(args)
    backend = host.factory(lambda *a: None)
    try:
        assert f"llama-server at {build.binary} (version: " in host.label and f"build {native.RELEASE}," in host.label
        assert list(backend.baseline(Request(prompt="Hi", max_new_tokens=3)))[-1].error is None
    finally:
        backend.close()
    assert asked == [build.binary]
    with pytest.raises(SystemExit, match="not a llama-server"):
        llamacpp_host(Namespace(**{**vars(args), "llamacpp_server": "/bin/true"}))
    with pytest.raises(SystemExit, match="cannot run it"):
        llamacpp_host(Namespace(**{**vars(args), "llamacpp_server": str(tmp_path / "missing")}))


@pytest.mark.parametrize("setting, note", [
    ("always [madvise] never", "; transparent huge pages madvise: llama.cpp runs without them"),
    ("[always] madvise never", "; transparent huge pages always: llama.cpp runs in them"),
    ("always madvise [never]", "; transparent huge pages never: llama.cpp runs without them"),
    (None, ""),  # no such file: a kernel without transparent huge pages, or not Linux
])
def test_the_build_says_whether_llama_cpp_gets_huge_pages(tmp_path, setting, note):
    """llama.cpp asks for no huge pages: its memory gets them only where the system's setting is `always`, which made
    its decoding 1.13-1.20x faster on our Intel Xeon. The status line says which holds here."""
    path = tmp_path / "enabled"
    if setting is not None:
        path.write_text(setting + "\n")
    assert huge_pages_note(path) == note


def test_a_binarys_version_line_is_bounded(tmp_path):
    """It goes into the status line (which escapes it, specconsole.app): a binary of the user's says what it likes."""
    from engine.llamacpp.server import VERSION_CHARS, binary_version

    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'version: <script>alert(1)</script>" + "x" * 5000 + "'\n")
    fake.chmod(0o755)
    line = binary_version(str(fake))
    assert line.startswith("version: <script>") and len(line) == VERSION_CHARS


def script(path: Path, text: str) -> str:
    path.write_text("#!/bin/sh\n" + text + "\n")
    path.chmod(0o755)
    return str(path)


def test_serves_tells_a_server_that_listens_from_one_that_dies(tmp_path):
    assert native.serves(script(tmp_path / "good", "echo 'main: listening on http://127.0.0.1:1'; exec sleep 60"),
                         "m.gguf") is None
    assert native.serves(script(tmp_path / "ill", "echo loading; kill -ILL $$"), "m.gguf") == "faults (SIGILL)"
    assert native.serves(script(tmp_path / "bad", "echo 'no such model' >&2; exit 1"), "m.gguf") == \
        "exits 1: no such model\n"
    mute = script(tmp_path / "mute", "exec sleep 60")
    assert native.serves(mute, "m.gguf", timeout_s=1) == "did not listen within 1 s"


def test_a_build_that_dies_on_a_model_is_built_again_without_amx(monkeypatch, tmp_path):
    """The probe's AMX programs ran on an AMX Xeon where llama-server's AMX matmul died of SIGILL: a build that faults
    on the model it is tried on is not kept; the AMX sets are marked in the probe's record, and the next build leaves
    them out. The compile is a script here (the real one takes minutes); the probe's record and the retry are the
    real ones."""
    monkeypatch.setenv("SPECCONSOLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "probe", lambda cxx=None: {f.name: "runs" for f in native.FEATURES})
    model = str(tmp_path / "small.gguf")
    built = []

    def fake_build(partial, features, cxx, on_progress, jobs):
        built.append(features)
        (partial / "work").mkdir(parents=True)
        dies = "kill -ILL $$" if "AMX_INT8" in features else "echo 'listening on http://127.0.0.1:1'; exec sleep 60"
        return Path(script(partial / "work" / "llama-server", dies))

    monkeypatch.setattr(native, "_build", fake_build)
    build = native.ensure_built(model=model)
    assert [("AMX_INT8" in f) for f in built] == [True, False]
    assert set(build.left_out) == set(native.UNSURE) and not set(build.features) & set(native.UNSURE)
    assert build.left_out["AMX_INT8"] == "faults (SIGILL) in llama-server"
    assert native.probed(native.compiler())["AMX_TILE"] == "faults (SIGILL) in llama-server"
    assert build.describe().endswith("; without AMX_TILE, AMX_INT8, AMX_BF16 (faults (SIGILL) in llama-server)")
    assert native.ensure_built(model=model) == build and len(built) == 2  # found, not built again
    assert [b.features for b in native.cached_builds()] == [build.features]


@pytest.mark.parametrize("server, kept", [("kill -ILL $$", False), ("echo 'cannot read the model'; exit 1", True)])
def test_without_amx_a_sigill_refuses_the_build_and_other_trouble_keeps_it(monkeypatch, tmp_path, server, kept):
    """SIGILL with no AMX set in: nothing left to leave out, the wheel serves instead (BuildError says why). A model
    the new server cannot serve for another reason is the model's trouble: the build is kept."""
    monkeypatch.setenv("SPECCONSOLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "probe", lambda cxx=None: {f.name: "runs" for f in native.FEATURES[:5]})

    def fake_build(partial, features, cxx, on_progress, jobs):
        (partial / "work").mkdir(parents=True)
        return Path(script(partial / "work" / "llama-server", server))

    monkeypatch.setattr(native, "_build", fake_build)
    model = str(tmp_path / "small.gguf")
    if kept:
        assert native.ensure_built(model=model).features == [f.name for f in native.FEATURES[:5]]
    else:
        with pytest.raises(native.BuildError, match=r"faults \(SIGILL\) on .*small.gguf, with no set left to leave"):
            native.ensure_built(model=model)
        assert native.cached_builds() == []
    assert not list(native.cache_root().glob("*.partial-*"))


def test_without_a_compiler_the_wheel_serves_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++, c++, clang++, cmake or ninja on it
    monkeypatch.delenv("CXX", raising=False)
    chosen = choose_build("auto")
    assert chosen.wheel
    assert chosen.description == (f"{WHEEL}: no build for this CPU here (no C++ compiler (g++) is installed)"
                                  + huge_pages_note())
    assert choose_build("wheel").wheel


def test_a_killed_build_leaves_nothing_half_made(build, tmp_path):
    """SIGKILL mid-build: no finished build in the cache, and the next build clears the remains before it starts."""
    cache = tmp_path / "cache"
    source = Path(native.cache_root()) / "source"
    (cache / "llama-server" / "source").mkdir(parents=True)
    for archive in source.glob("*.tar.gz"):  # the pinned source, so that this test does not download it again
        os.symlink(archive, cache / "llama-server" / "source" / archive.name)
    env = dict(os.environ, SPECCONSOLE_CACHE=str(cache))
    proc = subprocess.Popen([sys.executable, "-m", "engine.llamacpp.native", "build"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    root = cache / "llama-server"
    deadline = time.monotonic() + 120
    try:
        while not list(root.glob("*.partial-*/work/build/build.ninja")):  # configured: the compiling begins
            assert proc.poll() is None and time.monotonic() < deadline, "the build did not start"
            time.sleep(0.2)
        time.sleep(2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert native.cached_builds(root) == []
    assert list(root.glob("*.partial-*"))  # its remains, which a build removes under the lock before it starts
    native._remove_remains(root, list(root.glob("*.partial-*"))[0].name.split(".partial-")[0])
    assert not list(root.glob("*.partial-*"))


def test_each_method_maps_to_llama_servers_own_options():
    base = EngineConfig("speculative", "t.gguf", threads=2, ctx=2048)
    plain = server_args(base)
    assert plain[:6] == ["--model", "t.gguf", "--ctx-size", "2048", "--parallel", "1"] and "--spec-type" not in plain

    def options(spec: str) -> dict:
        args = server_args(parse_method(spec, replace(base, draft="d.gguf")))
        tail = args[args.index("--spec-type"):]
        return dict(zip(tail[::2], tail[1::2]))

    assert options("draft:k=6:p_min=0.5") == {
        "--spec-type": "draft-simple", "--spec-draft-model": "d.gguf", "--spec-draft-threads": "2",
        "--spec-draft-threads-batch": "2", "--spec-draft-n-max": "6", "--spec-draft-n-min": "0",
        "--spec-draft-p-min": "0.5"}
    assert options("ngram-simple:k=4:n=3") == {"--spec-type": "ngram-simple", "--spec-ngram-simple-size-m": "4",
                                               "--spec-ngram-simple-size-n": "3"}
    assert options("ngram-map-k:k=5") == {"--spec-type": "ngram-map-k", "--spec-ngram-map-k-size-m": "5"}
    assert options("ngram-mod:k=8:n=16") == {"--spec-type": "ngram-mod", "--spec-ngram-mod-n-max": "8",
                                             "--spec-ngram-mod-n-min": "8", "--spec-ngram-mod-n-match": "16"}
    assert options("ngram-cache") == {"--spec-type": "ngram-cache"}
    with pytest.raises(LlamaCppError, match="needs a draft GGUF"):
        server_args(parse_method("draft:k=4", base))
