"""vLLM server processes the console starts and stops: command line, environment, start-up, and the guarantee that
none outlives its console.

Each server is an engine.serving.guarded_process.GuardedProcess: it stops with the console, however the console ends, and
sees only an allow-list of its environment. Each managed port is
recorded (cache_dir()/servers/PORT.json: the guard's pid, the console's pid); at start, a port still held is either
freed, when the record shows it belongs to a console that is gone, or reported with the holder's pid and how to
stop it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from engine.serving.guarded_process import GuardedProcess, _group_alive, healthy, server_env, stop_group
from engine.cache import cache_dir
from engine.serving.stream import ServerError

log = logging.getLogger(__name__)


class VLLMError(ServerError):
    """A vLLM server that cannot be started, reached or trusted; the message says why (with its log's tail)."""


def memory_shares(n: int, split: tuple[float, ...] | None = None) -> tuple[float, ...]:
    """Each of `n` managed servers' share of the GPU memory, baseline first: `split` where given (one share per
    server), else 0.45 each for two servers and 0.9 split evenly for more."""
    split = split or ((0.45, 0.45) if n == 2 else (round(0.9 / n, 3),) * n)
    if len(split) != n:
        raise VLLMError(f"the memory split needs one share per server ({n}), got {split}")
    return split


@dataclass
class ServerConfig:
    role: str  # "baseline" | "speculative"
    model: str
    port: int
    python: str = sys.executable  # vLLM may live in its own virtualenv
    speculative: dict | None = None
    gpu: bool = False
    gpu_memory_utilization: float = 0.45
    cpu_core: int | None = None  # on CPU: the core this server's threads are bound to
    kv_cache_gb: int = 1
    max_model_len: int = 2048
    served_name: str = "target"
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict = field(default_factory=dict)  # e.g. VLLM_* settings for this server only
    # the key the server demands on /v1 (vLLM reads VLLM_API_KEY): in its environment, not on its command line,
    # which is logged and which `ps` shows to every user
    api_key: str | None = field(default=None, repr=False)

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", str(self.max_model_len), "--enable-per-request-metrics"]
        if self.gpu:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        else:
            cmd += ["--enforce-eager", "--dtype", "float32"]
        if self.speculative:
            cmd += ["--speculative-config", json.dumps(self.speculative),
                    "--per-request-spec-decode-metrics", "detailed"]
        return cmd + self.extra_args

    def env(self) -> dict:
        env = server_env(dict(os.environ)) | {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        if not self.gpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gb)
            if self.cpu_core is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu_core)
        return env | self.extra_env


class VLLMServer(GuardedProcess):
    """One vLLM server process (under its guard) with its log file; start() returns when it answers, or raises
    with the log's tail."""

    def __init__(self, config: ServerConfig, log_dir: Path):
        super().__init__(f"{config.role} vLLM server", log_dir / f"vllm-{config.role}-{config.port}.log", VLLMError)
        self.config = config

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def start(self, timeout: float = 600) -> None:
        claim_port(self.config.port, self.config.role)
        log.info("starting the %s vLLM server: %s", self.config.role, " ".join(self.config.command()))
        self.spawn(self.config.command(), self.config.env(), python=self.config.python)
        record_port(self.config.port, self.config.role, self.proc.pid)
        self.wait_ready(lambda: healthy(self.url), timeout, poll_s=1.0)
        log.info("%s server ready at %s", self.config.role, self.url)

    def stop(self) -> None:
        """Ask the guard to stop the server (it waits for vLLM's own shutdown); kill the whole group if it hangs."""
        super().stop(grace=40.0)
        if self.proc is not None:
            forget_port(self.config.port, self.proc.pid)


# --- who holds a port --------------------------------------------------------------------------------------------


def _record_path(port: int) -> Path:
    return cache_dir() / "servers" / f"{port}.json"


def record_port(port: int, role: str, guard_pid: int) -> None:
    """Note that this console's server (process group guard_pid) holds `port`."""
    me = psutil.Process()
    record = {"port": port, "role": role, "group": guard_pid, "group_created": psutil.Process(guard_pid).create_time(),
              "console_pid": me.pid, "console_created": me.create_time()}
    path = _record_path(port)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
        _prune(path.parent)
    except OSError as e:  # the record only helps the next start; the server itself is fine
        log.warning("could not record the %s server's port in %s: %s", role, path, e)


def _prune(records: Path) -> None:
    """Drop the records of servers whose process group is empty (a console killed outright leaves its records
    behind; its guard then stops the server, but cannot know where the console kept the record)."""
    for path in records.glob("*.json"):
        try:
            if not _group_alive(json.loads(path.read_text())["group"]):
                path.unlink(missing_ok=True)
        except (OSError, ValueError, KeyError):
            continue


def forget_port(port: int, guard_pid: int) -> None:
    path = _record_path(port)
    try:
        if json.loads(path.read_text()).get("group") == guard_pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def listener(port: int) -> psutil.Process | None:
    """The process listening on 127.0.0.1:port (or any address), if any and if it can be seen."""
    try:
        connections = psutil.net_connections(kind="inet")
    except psutil.AccessDenied:
        return None
    for c in connections:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            try:
                return psutil.Process(c.pid)
            except psutil.NoSuchProcess:
                return None
    return None


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int, created: float) -> bool:
    try:
        return psutil.Process(pid).create_time() == created
    except psutil.NoSuchProcess:
        return False


def orphan_group(port: int, holder: psutil.Process | None) -> int | None:
    """The process group of a server a console that is gone left on `port`, as that console recorded it; else None."""
    try:
        record = json.loads(_record_path(port).read_text())
    except (OSError, ValueError):
        return None
    if holder is None or _alive(record["console_pid"], record["console_created"]):
        return None  # a live console's server is in use: never take it
    try:
        mine = os.getpgid(holder.pid) == record["group"] and holder.create_time() >= record["group_created"]
    except (OSError, psutil.NoSuchProcess):
        return None
    return record["group"] if mine else None


def claim_port(port: int, role: str) -> None:
    """Make sure `port` is free for a new server: free it from an orphan this tool recorded, or explain who holds it."""
    if not port_in_use(port):
        return
    holder = listener(port)
    group = orphan_group(port, holder)
    if group is not None:
        log.warning("port %d is held by a vLLM server an earlier console left running (process group %d): "
                    "stopping it", port, group)
        stop_group(group)
        deadline = time.monotonic() + 10
        while port_in_use(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not port_in_use(port):
            _record_path(port).unlink(missing_ok=True)
            return
    if holder is None:
        who, how = "a process this user cannot see", f"Find it with `ss -ltnp 'sport = :{port}'`"
    else:
        who = f"pid {holder.pid} ({' '.join(_cmdline(holder))[:160]})"
        how = f"Stop it with `kill {holder.pid}`" + (
            f" (its whole process group: `kill -- -{os.getpgid(holder.pid)}`)" if _is_vllm(holder) else "")
    raise VLLMError(f"port {port} is already in use by {who}: cannot start the {role} server. {how}, "
                    "or start the console with other ports (--vllm-ports BASELINE,SPECULATIVE).")


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.AccessDenied, psutil.NoSuchProcess):
        return ["?"]


def _is_vllm(p: psutil.Process) -> bool:
    return any("vllm" in part for part in _cmdline(p))


def has_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
