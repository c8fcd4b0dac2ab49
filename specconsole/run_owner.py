"""Who runs a saved run: its owner (host, pid, and when that process started), so that a second console or `launch.py
suite` on the same history file marks as interrupted only the runs of processes that are gone: on this host, a run
whose owner pid no longer runs, or now belongs to a process that started at another time. Runs of another host
cannot be checked; they count as gone only once older than FOREIGN_RUN_MAX_AGE."""

from __future__ import annotations

import os
import socket
from datetime import datetime, timedelta, timezone
from pathlib import Path

# A run of another host cannot be checked for life; none takes a day, so one that "runs" longer is a dead process's.
FOREIGN_RUN_MAX_AGE = timedelta(hours=24)


def process_start(pid: int) -> str | None:
    """When process `pid` started ("boot id:clock ticks since boot", from Linux's /proc), or None if there is no
    such process (or no /proc). With the pid it names one process: a later process that reuses the pid has another
    start."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"  # field 22; the name before ")" may hold spaces
    except (OSError, IndexError):
        return None


def owner() -> dict:
    """This process, as a run's owner."""
    return {"owner_host": socket.gethostname(), "owner_pid": os.getpid(), "owner_started": process_start(os.getpid())}


def owner_gone(run: dict, host: str, at: datetime) -> bool:
    """Whether the process that owns this 'running' run is gone (see the module's docstring)."""
    if run["owner_pid"] is None:  # saved by a version that did not record owners
        return True
    if run["owner_host"] != host:
        try:
            created = datetime.fromisoformat(run["created_at"])
        except (TypeError, ValueError):  # no date: nothing says it is old
            return False
        return at - (created if created.tzinfo else created.replace(tzinfo=timezone.utc)) > FOREIGN_RUN_MAX_AGE
    if Path("/proc/self/stat").exists():
        return process_start(run["owner_pid"]) != run["owner_started"]
    try:  # no /proc: a live pid is all we can check
        os.kill(run["owner_pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False
