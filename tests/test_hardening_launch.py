"""The console is reachable from this machine only, unless the user asks otherwise with a login: a non-loopback bind
or a public share link without SPECCONSOLE_AUTH is refused, and GRADIO_SHARE (or a hosted notebook) never opens a
link by itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_ports

ROOT = Path(__file__).resolve().parent.parent


def _launch(args: list[str], tmp_path: Path, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "SPECCONSOLE_AUTH"}
    return subprocess.run([sys.executable, "launch.py", "--db", str(tmp_path / "h.db"), *args], cwd=ROOT,
                          env={**clean, **env}, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [["--host", "0.0.0.0"], ["--share"], ["--host", "192.0.2.1", "--share"]])
def test_exposed_console_without_login_is_refused_with_what_to_set(args, tmp_path):
    done = _launch(args, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "refusing to serve" in done.stderr and "SPECCONSOLE_AUTH=user:password" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "h.db").exists()  # refused before anything was opened or loaded


def test_half_a_login_is_refused(tmp_path):
    done = _launch(["--share"], tmp_path, SPECCONSOLE_AUTH="admin")
    assert done.returncode == 2 and "must hold user:password" in done.stderr, done.stderr[-2000:]


def test_gradio_share_in_the_environment_opens_no_public_link(tmp_path, monkeypatch):
    """Gradio reads GRADIO_SHARE (and turns sharing on in hosted notebooks) when launch() is not told; the console
    always tells it. The tunnel itself cannot be opened here (no network): a call to it is the failure."""
    import gradio.networking

    from specconsole.app import launch
    from specconsole.history import History
    from specconsole.host import ModelHost

    tunnels = []
    monkeypatch.setenv("GRADIO_SHARE", "true")
    monkeypatch.setattr(gradio.networking, "setup_tunnel", lambda *a, **k: tunnels.append(k) or "https://x.invalid")
    host = ModelHost("nothing", lambda progress: None)  # the page comes up without models
    app = launch(host, History(tmp_path / "h.db"), "127.0.0.1", free_ports(1)[0], prevent_thread_lock=True)
    try:
        assert app.share is False and tunnels == []
    finally:
        app.close()
