"""`minivllm engine` runs on its own; frontends attach by address, one after another."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from minivllm import LLM, SamplingParams
from tests.procs import wait_gone

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def engine_address(tiny_llama):
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO_ROOT, "bin", "minivllm"), "engine", "--model", tiny_llama,
         "--address", address, "--max-model-len", "128"],
    )
    yield address, proc
    proc.terminate()
    proc.wait(timeout=15)


def test_attach_generate_detach_attach_again(tiny_llama, engine_address) -> None:
    address, proc = engine_address
    with LLM(tiny_llama, max_model_len=128) as local:
        expected = local.generate(["Hello", "The quick brown fox"], GREEDY, use_tqdm=False)

    first = LLM(engine_address=address)
    assert first.engine_info.max_model_len == 128
    outs = first.generate(["Hello", "The quick brown fox"], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert outs[0].outputs[0].text == expected[0].outputs[0].text
    first.shutdown()  # detaches; the engine keeps running
    assert proc.poll() is None

    second = LLM(engine_address=address)
    outs = second.generate("The quick brown fox", GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected[1].outputs[0].token_ids
    worker_pids = second.engine_info.worker_pids
    second.shutdown()
    assert proc.poll() is None

    proc.terminate()  # SIGTERM: the engine stops its workers and exits cleanly
    assert proc.wait(timeout=15) == 0
    assert wait_gone(worker_pids) == []


def test_attach_to_nothing_is_a_clear_error() -> None:
    with pytest.raises(ConnectionError, match="no minivllm engine answered"):
        from minivllm.frontend.core_client import EngineCoreClient

        EngineCoreClient.attach(f"tcp://127.0.0.1:{free_port()}", timeout=1.0)
