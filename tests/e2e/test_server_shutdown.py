"""`minivllm serve` on SIGTERM: it stops accepting connections, lets requests in flight finish (or
aborts them after --shutdown-timeout), stops the engine and its workers, and exits 0."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import openai

from tests.procs import wait_gone
from tests.server_procs import ServerProcess, children_of

FLAGS = ["--max-model-len", "512", "--max-num-batched-tokens", "128"]


def stream_in_thread(server: ServerProcess, max_tokens: int) -> tuple[threading.Thread, dict, threading.Event]:
    """A streamed completion read in a thread; `result` gets its text, finish reason, usage or error."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    result: dict = {"text": "", "finish_reason": None, "usage": None, "error": None, "chunks": 0}
    first_chunk = threading.Event()

    def read() -> None:
        try:
            for chunk in client.completions.create(model=client.models.list().data[0].id, prompt="Once upon a time",
                                                   max_tokens=max_tokens, temperature=0, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}):
                first_chunk.set()
                result["chunks"] += 1
                if chunk.choices:
                    result["text"] += chunk.choices[0].text
                    result["finish_reason"] = chunk.choices[0].finish_reason or result["finish_reason"]
                if chunk.usage:
                    result["usage"] = chunk.usage
        except Exception as e:  # noqa: BLE001 (what the client saw is the test's business)
            result["error"] = e
        first_chunk.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, result, first_chunk


def refuses_connections(server: ServerProcess, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(server.url + "/health", timeout=1).close()
        except ConnectionRefusedError:
            return True
        except OSError as e:
            if isinstance(getattr(e, "reason", None), ConnectionRefusedError):
                return True
        time.sleep(0.05)
    return False


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_llama) -> None:
    server = ServerProcess(tiny_llama, "--shutdown-timeout", "300", *FLAGS)
    try:
        engine_pids = children_of(server.proc.pid)
        assert len(engine_pids) >= 2  # the engine and its worker
        thread, result, first_chunk = stream_in_thread(server, max_tokens=100)
        assert first_chunk.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        chunks_at_sigterm = result["chunks"]
        assert refuses_connections(server)  # no new connections while the old request drains
        thread.join(240)
        assert result["error"] is None, result["error"]
        assert result["finish_reason"] == "length" and result["usage"].completion_tokens == 100
        assert result["chunks"] > chunks_at_sigterm  # it really was in flight when the signal came
        assert server.proc.wait(60) == 0, server.output()
        assert wait_gone(engine_pids) == []
    finally:
        server.stop()


def test_sigterm_aborts_what_outlasts_the_shutdown_timeout(tiny_llama) -> None:
    # 0.1 s of grace: a tiny model on a fast CPU makes ~1 token per ms, so 480 tokens outlast it ~5x.
    server = ServerProcess(tiny_llama, "--shutdown-timeout", "0.1", *FLAGS)
    try:
        engine_pids = children_of(server.proc.pid)
        thread, result, first_chunk = stream_in_thread(server, max_tokens=480)
        assert first_chunk.wait(60)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.output()
        thread.join(30)
        assert result["usage"] is None  # cut short: it never got to its end
        assert time.monotonic() - start < 30  # 0.1 s of grace, then the engine stops (no 480 tokens' wait)
        assert wait_gone(engine_pids) == []
    finally:
        server.stop()
