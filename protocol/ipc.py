"""Plumbing shared by every process: socket addresses and starting child processes.

Children are started with subprocess (a fresh interpreter running one `minivllm.<module>` as
__main__), never multiprocessing: its arguments are a JSON config on the command line, so nothing
is pickled, and the kernel kills each child when its parent dies (PR_SET_PDEATHSIG), so no orphan
survives.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import uuid

# The `minivllm` package's directory: site-packages/minivllm when installed, the checkout's root
# in an editable install or when run through bin/minivllm.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A child imports `minivllm` from PACKAGE_DIR, the very copy its parent runs, then runs the module
# as `python -m` would. `python -m minivllm...` alone would not do: a checkout run through
# bin/minivllm has no directory named `minivllm` on any path.
# `kill -USR1 PID` makes an engine or worker process print every thread's stack to stderr (a stuck
# step or collective shows where it waits).
_CHILD_MAIN = """\
import faulthandler, importlib.util, runpy, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)
package_dir, module = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location(
    "minivllm", f"{package_dir}/__init__.py", submodule_search_locations=[package_dir])
package = importlib.util.module_from_spec(spec)
sys.modules["minivllm"] = package
spec.loader.exec_module(package)
sys.argv = [module, *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def private_socket_dir() -> str:
    """$TMPDIR/minivllm-<uid>: a directory only this user can enter (mode 0700), so no other local
    user can connect to the Unix sockets in it. Made on first use; one that exists must be ours
    and private, or we refuse to put sockets there."""
    path = os.path.join(tempfile.gettempdir(), f"minivllm-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{path} exists but is not a directory owned by this user; remove it "
                              "(minivllm keeps its private sockets there).")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def new_ipc_address(name: str) -> str:
    """A fresh ipc:// address (a Unix socket: local only) in this user's private socket directory."""
    return f"ipc://{private_socket_dir()}/{name}-{uuid.uuid4().hex[:12]}"


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


def die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn_child(module: str, args: list[str], env: dict[str, str] | None = None,
                pass_fds: tuple[int, ...] = (), stdin: int = subprocess.DEVNULL) -> subprocess.Popen:
    """Run `python -m module *args` (module: `minivllm.<...>`) as a child that dies with this process.
    pass_fds: file descriptors it inherits, under the same numbers (no other one is); stdin:
    subprocess.PIPE to write to it (Popen.stdin), else nothing."""
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD_MAIN, PACKAGE_DIR, module, *args],
        env=dict(os.environ if env is None else env),
        preexec_fn=die_with_parent,
        stdin=stdin,
        pass_fds=pass_fds,
    )


def hand_over_stdin(proc: subprocess.Popen, payload: bytes) -> None:
    """Write `payload` to a child started with stdin=subprocess.PIPE and close its stdin (b"": only
    close, which tells a child waiting on it for its config to exit). A child already gone is left
    to whoever watches it to report."""
    assert proc.stdin is not None
    try:
        proc.stdin.write(payload)
    except BrokenPipeError:
        pass
    finally:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass


def exit_without_teardown(code: int) -> None:
    """End this process now, once its logs and output are flushed: for a process that has closed
    what it opened. The interpreter's own teardown costs ~1-2 s with torch and transformers loaded
    (and torch.distributed's rendezvous store has been seen to stall it for seconds)."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
