"""Keeps a vLLM server from outliving the console that started it. Standard library only: it runs under the vLLM
virtualenv's python, which cannot import the console's packages.

    python server_guard.py FD -- python -m vllm.entrypoints.openai.api_server ...

The console starts this guard in a session of its own, holding the write end of a pipe whose read end is FD. The
guard starts the server as its child (same process group) and waits. The read end reports end-of-file the moment
the console's process is gone, however it ended: exit, exception, SIGTERM, SIGHUP or SIGKILL (the kernel closes
its descriptors). Then, or on SIGTERM / SIGINT / SIGHUP to the guard (the console's own stop), the guard asks the
server to shut down (SIGTERM), waits, and kills what is left of the process group (vLLM's engine core and workers).
If the server exits by itself, the guard clears the group and exits with the server's code.
PR_SET_PDEATHSIG alone would not do: it fires when the *thread* that started the child ends, and the console starts
servers from a loader thread that ends as soon as they are up.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

GRACE_S = 20.0  # vLLM's own shutdown (engine core, workers) takes a few seconds


def group_members() -> list[int]:
    """Other processes in this process group (Linux: /proc; elsewhere none are known)."""
    me, group, found = os.getpid(), os.getpgid(0), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":  # fields: state, ppid, pgrp
            found.append(int(entry))
    return found


def clear_group() -> None:
    for pid in group_members():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    fd, command = int(argv[0]), argv[argv.index("--") + 1:]
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    server = subprocess.Popen(command)
    while server.poll() is None and not stop:
        try:
            readable, _, _ = select.select([fd], [], [], 0.5)
        except InterruptedError:
            continue
        if readable and not os.read(fd, 1):
            sys.stderr.write("server_guard: the console is gone; stopping the vLLM server\n")
            break
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    clear_group()
    server.wait()
    return server.returncode if server.returncode >= 0 else 128 - server.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
