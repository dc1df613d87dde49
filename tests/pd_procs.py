"""`minivllm proxy` as a real subprocess on a free loopback port (its backends are ServerProcesses)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

from minivllm.protocol.ipc import die_with_parent

from tests.server_procs import MINIVLLM, free_port


def wait_for_pull(puller, timeout: float = 10.0, interval: float = 0.01) -> tuple[set[str], dict[str, str]]:
    """A KV block puller's next report (ids done, ids failed -> why), or AssertionError after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = puller.take_finished()
        if done or failed:
            return done, failed
        time.sleep(interval)
    raise AssertionError("the pull neither finished nor failed")


def wait_for_release(server, req_ids: set[str], timeout: float = 10.0, interval: float = 0.01) -> set[str]:
    """Every id a KV block server released until `req_ids` are among them, or AssertionError after
    timeout. (A p2p transport releases once its sends complete, which may be just after the
    consumer reports the pull done.)"""
    deadline = time.monotonic() + timeout
    released: set[str] = set()
    while time.monotonic() < deadline:
        released |= server.take_released()
        if released >= req_ids:
            return released
        time.sleep(interval)
    raise AssertionError(f"the server released {sorted(released)}, not {sorted(req_ids)}")


class ProxyProcess:
    """`minivllm proxy --prefill ... --decode ...`; .url is its base URL. Up once it answers /health
    (whatever the status: a backend may be down on purpose)."""

    def __init__(self, prefill: list[str], decode: list[str], *args: str, timeout: float = 60.0,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"minivllm-proxy-{self.port}.log")
        self.log = open(self.log_path, "w+")
        urls = [*(["--prefill", ",".join(prefill)] if prefill else []), *(["--decode", ",".join(decode)] if decode else [])]
        self.proc = subprocess.Popen([*MINIVLLM, "proxy", *urls, "--port", str(self.port), *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=die_with_parent)  # no orphan server if the test run is killed
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the proxy exited with {self.proc.returncode}:\n{self.output()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=10).close()
                break
            except urllib.error.HTTPError:
                break  # it answers (503: some backend is down)
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the proxy did not come up in {timeout} s:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
