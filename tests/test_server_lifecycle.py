"""Managed servers never outlive their console (engine.vllm.server, engine/serving/server_guard.py), and a port still held at
start is freed or explained. Real processes, a stand-in HTTP server instead of vLLM (which test_vllm_real.py and
test_vllm_lifecycle.py run for real): the guard does not care what it guards."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from engine.vllm.server import VLLMError, claim_port, port_in_use, record_port
from tests.conftest import free_ports

ROOT = Path(__file__).resolve().parent.parent

# answers /health like vLLM, and starts a child of its own, as vLLM starts its engine core
STAND_IN = textwrap.dedent("""
    import http.server, subprocess, sys
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
""")

# a console: starts the stand-in under its guard, as VLLMBackend.managed starts vLLM, prints the guard's pid, waits
CONSOLE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from engine.vllm.server import ServerConfig, VLLMServer

    class StandIn(ServerConfig):
        def command(self):
            return [sys.executable, "-c", sys.argv[2], str(self.port)]

    server = VLLMServer(StandIn("baseline", "-", int(sys.argv[1])), Path(sys.argv[3]))
    server.start(timeout=60)
    print(server.proc.pid, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def records(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCONSOLE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "servers"


def start_console(port: int, tmp_path: Path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    # default SIGHUP even when the tests run under nohup (which makes children ignore it): the console must die of it
    console = subprocess.Popen([sys.executable, "-c", CONSOLE, str(port), STAND_IN, str(tmp_path)], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                               preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    guard = psutil.Process(int(console.stdout.readline()))
    deadline = time.monotonic() + 30
    while len(guard.children(recursive=True)) < 2:  # the stand-in and its child
        assert time.monotonic() < deadline, "the stand-in never started its child"
        time.sleep(0.1)
    return console, [guard, *guard.children(recursive=True)]


def assert_all_gone(processes: list[psutil.Process], port: int, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes) or port_in_use(port):
        assert time.monotonic() < deadline, [p for p in processes if p.is_running()]
        time.sleep(0.2)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])
def test_server_dies_with_its_console(tmp_path, records, how):
    port = free_ports(1)[0]
    console, processes = start_console(port, tmp_path)
    assert port_in_use(port) and (records / f"{port}.json").exists()
    console.send_signal(how)
    console.wait(10)
    assert_all_gone(processes, port)
    record_port(free_ports(1)[0], "baseline", os.getpid())  # the next start drops the record of the gone server
    assert not (records / f"{port}.json").exists()


def test_a_port_held_by_someone_else_is_reported_with_its_pid(records):
    port = free_ports(1)[0]
    holder = subprocess.Popen([sys.executable, "-c", STAND_IN, str(port)])
    try:
        deadline = time.monotonic() + 20
        while not port_in_use(port):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(VLLMError, match=f"port {port} is already in use by pid {holder.pid}") as err:
            claim_port(port, "baseline")
        assert f"kill {holder.pid}" in str(err.value) and "--vllm-ports" in str(err.value)
        assert holder.poll() is None  # not ours: left alone
    finally:
        holder.kill()
        holder.wait()


def test_a_server_an_earlier_console_left_behind_is_stopped(records):
    port = free_ports(1)[0]
    orphan = subprocess.Popen([sys.executable, "-c", STAND_IN, str(port)], start_new_session=True)
    gone_console = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_console.wait()
    try:
        deadline = time.monotonic() + 20
        while not port_in_use(port):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # what that console wrote when it started the server, as record_port writes it
        record_port(port, "baseline", orphan.pid)
        record = json.loads((records / f"{port}.json").read_text())
        live = dict(record)
        (records / f"{port}.json").write_text(json.dumps(record | {"console_pid": gone_console.pid}))
        claim_port(port, "baseline")
        assert not port_in_use(port) and orphan.wait(5) is not None
        assert not (records / f"{port}.json").exists()
    finally:
        if orphan.poll() is None:
            orphan.kill()
    # and a server whose console still runs (this process) is never taken
    holder = subprocess.Popen([sys.executable, "-c", STAND_IN, str(port)], start_new_session=True)
    try:
        while not port_in_use(port):
            time.sleep(0.1)
        record_port(port, "baseline", holder.pid)
        assert live["console_pid"] == os.getpid()
        with pytest.raises(VLLMError, match="already in use"):
            claim_port(port, "baseline")
        assert holder.poll() is None
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


# stands in for vllm.entrypoints.openai.api_server (found through PYTHONPATH, which managed servers get): answers what
# VLLMBackend.managed asks while starting and warming up, demands VLLM_API_KEY on /v1 as vLLM does, and records its
# environment and each request's Authorization header in the model directory
FAKE_VLLM = textwrap.dedent("""
    import argparse, json, os
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from pathlib import Path

    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--port", type=int)
    args, _ = parser.parse_known_args()
    out = Path(args.model)
    (out / f"env-{args.port}.json").write_text(json.dumps(dict(os.environ)))
    key = os.environ.get("VLLM_API_KEY")
    TOKEN = {"index": 0, "delta": {"content": "a"}, "token_ids": [7], "finish_reason": "length",
             "logprobs": {"content": [{"token": "a", "logprob": -0.5}]}}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def allowed(self):
            with open(out / "requests.jsonl", "a") as f:
                f.write(json.dumps([args.port, self.path, self.headers.get("Authorization")]) + "\\n")
            if key and self.path.startswith("/v1") and self.headers.get("Authorization") != f"Bearer {key}":
                self.send(401, {"error": "Unauthorized"})
                return False
            return True

        def send(self, status, data, kind="application/json"):
            body = data.encode() if isinstance(data, str) else json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.allowed():
                self.send(200, 'vllm:spec_decode_num_drafts_total{engine="0"} 1.0\\n', "text/plain")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if not self.allowed():
                return
            if self.path == "/tokenize":
                self.send(200, {"tokens": [1, 2]})
            elif body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for chunk in ({"choices": [TOKEN], "prompt_token_ids": [1, 2]},
                              {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}):
                    self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
                self.wfile.write(b"data: [DONE]\\n\\n")
            else:  # the sampling check's scoring: prompt_logprobs over prompt + output
                self.send(200, {"choices": [
                    {"index": i, "prompt_logprobs": [None, None] + [{str(t): {"logprob": -0.5}} for t in p[2:]]}
                    for i, p in enumerate(body["prompt"])]})

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
""")


@pytest.mark.parametrize("api_key", [None, "key-123"], ids=["no key", "a key"])
def test_managed_servers_get_the_key_and_none_of_the_consoles_secrets(tmp_path, records, monkeypatch, api_key):
    """The console's environment holds its login and a VLLM_API_KEY; the managed servers get neither, but the key
    the backend is given (then the client sends it, and the warm-up, which a server demanding a key the client does
    not send fails with 401, passes)."""
    from engine.vllm.backend import VLLMBackend
    from engine.vllm.config import speculative_config

    package = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").touch()
    (package / "api_server.py").write_text(FAKE_VLLM)
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("SPECCONSOLE_AUTH", "admin:console-password")
    monkeypatch.setenv("VLLM_API_KEY", "the-consoles-key")
    ports = tuple(free_ports(2))
    backend = VLLMBackend.managed(str(model), speculative_config("ngram", 2), gpu=False, ports=ports,
                                  log_dir=tmp_path, api_key=api_key)
    try:
        requests = [json.loads(line) for line in (model / "requests.jsonl").read_text().splitlines()]
        v1 = [(port, auth) for port, path, auth in requests if path.startswith("/v1")]
        assert {port for port, _ in v1} == set(ports)  # both warmed up
        assert {auth for _, auth in v1} == {f"Bearer {api_key}" if api_key else None}
        for port in ports:
            env = json.loads((model / f"env-{port}.json").read_text())
            assert "SPECCONSOLE_AUTH" not in env and env.get("VLLM_API_KEY") == api_key
            assert env["PYTHONPATH"] == str(tmp_path / "fake") and env["PATH"] == os.environ["PATH"]
    finally:
        backend.close()
