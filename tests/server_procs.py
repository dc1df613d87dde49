"""Start `minivllm serve` as a real subprocess on a free loopback port, wait for /health, stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from minivllm.protocol.ipc import die_with_parent

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINIVLLM = [sys.executable, os.path.join(REPO_ROOT, "bin", "minivllm")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    """Live descendants of `pid` (from /proc), e.g. the engine and its workers."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] not in ("Z", "X"):
            parents[int(entry)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        found += kids
        frontier += kids
    return found


class ServerProcess:
    """`minivllm serve MODEL --port P ...`; .url is its base URL (http://127.0.0.1:P)."""

    def __init__(self, model: str, *args: str, env: dict[str, str] | None = None, timeout: float = 90.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"minivllm-serve-{self.port}.log")
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen([*MINIVLLM, "serve", "--model", model, "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                     preexec_fn=die_with_parent)  # no orphan server if the test run is killed
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not come up in {timeout} s:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL (and fail loudly in the caller's asserts) if it does not go."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                for pid in children_of(self.proc.pid):
                    os.kill(pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
