"""An engine started beside its config (frontend/core_client.py's config_beside_engine): the
EngineCore and its worker rank 0 start while the frontend resolves the config, rank 0 serves the
engine it was started for, and whatever fails on the way leaves no process behind."""

from __future__ import annotations

import os
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.core.executor import PrestartedWorker
from minivllm.frontend import core_client
from minivllm.frontend.core_client import PendingEngine
from tests.procs import child_processes, pid_alive, wait_gone

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_worker_rank_0_is_the_one_started_before_the_config(tiny_llama) -> None:
    with LLM(tiny_llama, max_model_len=128) as llm:
        worker_pid = llm.engine_info.worker_pids[0]
        assert "--config-stdin" in child_processes(llm.engine_info.engine_pid)[worker_pid]
        out = llm.generate("Hello", GREEDY, use_tqdm=False)[0]
        pids = [llm.engine_info.engine_pid, worker_pid]
    assert wait_gone(pids, timeout=10) == []
    # Started after its config, as with MINIVLLM_PRESTART_ENGINE=0, the same tokens come out.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(core_client, "PRESTART_ENGINE", False)
        with LLM(tiny_llama, max_model_len=128) as llm:
            worker_pid = llm.engine_info.worker_pids[0]
            assert "--config-stdin" not in child_processes(llm.engine_info.engine_pid)[worker_pid]
            assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_a_config_that_fails_stops_the_engine_started_beside_it(tiny_llama) -> None:
    before = set(child_processes(os.getpid()))
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_llama, max_model_len=10**9)
    assert set(child_processes(os.getpid())) - before == set()


@pytest.mark.parametrize("frontend", ["LLM", "AsyncLLM"])
def test_a_tokenizer_that_fails_after_the_engine_is_up_stops_it(tmp_path, frontend: str) -> None:
    """The engine serves before the frontend's tokenizer is read (frontend/engine_start.py): a
    tokenizer that fails to load then stops that engine before the error reaches the caller."""
    from minivllm import AsyncLLM
    from tests.tiny_models import build_tiny_model

    path = build_tiny_model(str(tmp_path / "model"), arch="llama")
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write("{not json")
    before = set(child_processes(os.getpid()))
    with pytest.raises(ValueError):  # (json's decode error is a ValueError)
        (LLM if frontend == "LLM" else AsyncLLM)(path, max_model_len=128)
    assert wait_gone(list(set(child_processes(os.getpid())) - before), timeout=10) == []


def test_a_pending_engine_cancelled_takes_its_worker_with_it() -> None:
    pending = PendingEngine()
    engine_pid = pending.proc.pid
    # Its worker starts at once (it imports torch before it reads its config).
    for _ in range(600):  # (up to 30 s: a loaded box starts interpreters slowly)
        workers = [pid for pid, cmd in child_processes(engine_pid).items() if "minivllm.worker.worker" in cmd]
        if workers:
            break
        time.sleep(0.05)
    assert workers, "the engine started no worker before its config"
    pending.cancel()
    assert pending.proc.returncode is not None
    assert wait_gone([engine_pid, *workers], timeout=10) == []


def test_an_unused_prestarted_worker_is_stopped() -> None:
    worker = PrestartedWorker()
    assert pid_alive(worker.proc.pid)
    worker.stop()
    assert worker.proc.returncode is not None
