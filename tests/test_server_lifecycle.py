"""Managed servers never outlive their console (engine.vllm_server, engine/server_guard.py), and a port still held at
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

from engine.vllm_server import VLLMError, claim_port, port_in_use, record_port
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
    from engine.vllm_server import ServerConfig, VLLMServer

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
