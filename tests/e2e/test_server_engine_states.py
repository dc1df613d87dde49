"""What `minivllm serve` answers when its engine cannot serve: a dead engine is a 503 (and /health
says so), an engine full of requests refuses with a 503 "overloaded" while the others finish, and a
keyed engine is reached with --engine-key-file."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from benchmarks.soak_engine import free_tcp_address, start_engine, wait_for_engine
from tests.procs import wait_gone
from tests.server_procs import ServerProcess, children_of

KEY = "0123456789abcdef-serve-engine-key"


def health_status(server: ServerProcess) -> int:
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def test_dead_engine_is_a_503_and_health_says_so(tiny_llama) -> None:
    server = ServerProcess(tiny_llama, "--max-model-len", "512")
    try:
        engine_and_workers = children_of(server.proc.pid)
        assert engine_and_workers and health_status(server) == 200
        for pid in engine_and_workers:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while health_status(server) != 503:
            assert time.monotonic() < deadline, "/health still says healthy after the engine died"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as error:
            client.completions.create(model=tiny_llama, prompt="Hello", max_tokens=4)
        assert error.value.status_code == 503
        assert error.value.body["type"] and "engine" in error.value.body["message"].lower()
    finally:
        server.stop()
    assert not wait_gone(engine_and_workers)


def test_overloaded_keyed_engine_is_a_503_while_the_rest_are_served(tiny_llama, tmp_path) -> None:
    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    address = free_tcp_address()
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_ENGINE_KEY"}
    engine = start_engine(tiny_llama, address, "--max-model-len", "512", "--engine-key-file", str(key_file),
                          "--max-pending-requests", "2", env=env)
    server = None
    try:
        wait_for_engine(address, engine, KEY).shutdown()
        # The server's own bound is far above the engine's: the engine is what refuses.
        server = ServerProcess(tiny_llama, "--engine-address", address, "--engine-key-file", str(key_file),
                               "--max-pending-requests", "64", env=env)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        results: list = [None] * 6

        def ask(i: int) -> None:
            try:
                results[i] = client.completions.create(model=tiny_llama, prompt="Once upon a time", max_tokens=200,
                                                       temperature=0, extra_body={"ignore_eos": True})
            except openai.APIStatusError as e:
                results[i] = e

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        served = [r for r in results if isinstance(r, openai.types.Completion)]
        refused = [r for r in results if isinstance(r, openai.APIStatusError)]
        assert len(served) + len(refused) == 6 and served and refused, results
        assert all(len(r.choices[0].text) > 0 and r.usage.completion_tokens == 200 for r in served)
        assert all(r.status_code == 503 and "overload" in r.body["message"].lower() for r in refused)
        # Once the flood is over the engine serves again.
        again = client.completions.create(model=tiny_llama, prompt="Hello", max_tokens=4, temperature=0)
        assert again.usage.completion_tokens == 4
    finally:
        if server is not None:
            server.stop()
        engine.terminate()
        engine.wait(timeout=20)
