"""Plumbing shared by every process: socket addresses and starting child processes.

Children are started with subprocess (a fresh interpreter running `python -m <module>`), never
multiprocessing: its arguments are a JSON config on the command line, so nothing is pickled, and
the kernel kills each child when its parent dies (PR_SET_PDEATHSIG), so no orphan survives.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import uuid

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def new_ipc_address(name: str) -> str:
    """A fresh ipc:// address in the temp dir (a Unix socket: local only)."""
    return f"ipc://{tempfile.gettempdir()}/minivllm-{name}-{uuid.uuid4().hex[:12]}"


def free_loopback_tcp_address() -> str:
    """tcp://127.0.0.1:PORT with a port free right now (the OS picks it). Another process could
    take it before it is bound again; on loopback, within a second, that is rare."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def remove_ipc_file(address: str) -> None:
    if address.startswith("ipc://"):
        try:
            os.unlink(address[len("ipc://") :])
        except FileNotFoundError:
            pass


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn_child(module: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Run `python -m module *args` as a child that dies with this process."""
    child_env = dict(os.environ if env is None else env)
    # The child must import this checkout even when it is not pip-installed.
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, child_env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        env=child_env,
        preexec_fn=_die_with_parent,
        stdin=subprocess.DEVNULL,
    )


def stop_child(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """Wait for a child asked to exit; terminate, then kill it if it lingers."""
    for sig_fn in (None, proc.terminate, proc.kill):
        if sig_fn is not None:
            sig_fn()
        try:
            proc.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            continue
