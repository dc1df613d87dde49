"""Engine behaviour through the public LLM API: batching, bad input, sampling, hygiene."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from minivllm import LLM, EngineDeadError, SamplingParams
from tests.procs import pid_alive, wait_gone

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, max_num_batched_tokens=64, max_model_len=128) as engine:
        yield engine


def test_outputs_in_prompt_order_with_text(llm) -> None:
    prompts = ["Hello", "What is the capital of France?", "One, two"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    tokenizer = llm.get_tokenizer()
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 12 and completion.finish_reason == "length"
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_prompt_alone_equals_prompt_in_batch_of_16(llm) -> None:
    prompts = [f"The scheduler hands out a budget {i} " * (1 + i % 5) for i in range(16)]
    batch = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i in (0, 7, 15):
        alone = llm.generate(prompts[i], GREEDY, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids


@pytest.mark.parametrize(
    "make_request, message",
    [
        (lambda: ("", GREEDY), "empty"),
        (lambda: ({"prompt_token_ids": []}, GREEDY), "empty"),
        (lambda: ({"prompt_token_ids": [5] * 129}, GREEDY), "max_model_len"),
        (lambda: ({"prompt_token_ids": [1, 2, 512]}, GREEDY), "outside the vocabulary"),
        (lambda: ({"prompt_token_ids": [1, -1]}, GREEDY), "outside the vocabulary"),
        (lambda: ("Hello", SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda: ("Hello", SamplingParams(temperature=-0.5)), "temperature"),
    ],
)
def test_bad_input_is_a_value_error_and_engine_keeps_serving(llm, make_request, message) -> None:
    with pytest.raises(ValueError, match=message):
        prompt, params = make_request()
        llm.generate(prompt, params, use_tqdm=False)
    out = llm.generate("Hello", GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12


def test_generation_stops_at_max_model_len(llm) -> None:
    out = llm.generate({"prompt_token_ids": [3] * 120}, SamplingParams(max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 128 - 120
    assert out.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(llm) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    first = llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(["Once upon a time", "Hello", "The quick"], [seeded, GREEDY, GREEDY], use_tqdm=False)
    assert crowd[0].outputs[0].token_ids == first
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    draws = {tuple(o.outputs[0].token_ids) for o in llm.generate(["Once upon a time"] * 4, unseeded, use_tqdm=False)}
    assert len(draws) > 1  # temperature sampling really samples


def test_stop_token_ids_end_a_request(llm) -> None:
    free = llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free[5]
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[: free.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_skip_tokenizer_init_takes_token_ids(tiny_llama) -> None:
    with LLM(tiny_llama, skip_tokenizer_init=True, max_model_len=128) as llm:
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].text == ""
        with pytest.raises(ValueError, match="prompt_token_ids"):
            llm.generate("text needs a tokenizer", GREEDY, use_tqdm=False)


def test_the_engines_processes_freeze_their_start_up_heap(tiny_llama, capfd) -> None:
    """The EngineCore and its worker each move their start-up heap out of the collector's passes once
    they are up (protocol/gc_heap.py), and serve as before."""
    with LLM(tiny_llama, max_model_len=128) as llm:
        assert len(llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12
    err = capfd.readouterr().err
    frozen = {who: int(n) for who, n in re.findall(r"(EngineCore|worker 0): (\d+) objects moved out of the garbage "
                                                   r"collector's passes", err)}
    assert set(frozen) == {"EngineCore", "worker 0"} and min(frozen.values()) > 1000, err[-2000:]


def test_shutdown_leaves_no_child_process(tiny_llama) -> None:
    llm = LLM(tiny_llama, max_model_len=128)
    pids = [llm.engine_info.engine_pid, *llm.engine_info.worker_pids]
    assert all(pid_alive(p) for p in pids)
    llm.generate("Hello", GREEDY, use_tqdm=False)
    llm.shutdown()
    assert wait_gone(pids, timeout=10) == []


def test_killed_worker_raises_engine_dead_error(tiny_llama) -> None:
    llm = LLM(tiny_llama, max_model_len=512, max_num_batched_tokens=16)
    pids = [llm.engine_info.engine_pid, *llm.engine_info.worker_pids]
    worker_pid = llm.engine_info.worker_pids[0]
    long_job = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)  # many seconds of steps
    threading.Timer(1.0, os.kill, (worker_pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker"):
        llm.generate(["Hello"] * 64, long_job, use_tqdm=False)
    assert time.monotonic() - start < 11
    with pytest.raises(EngineDeadError):  # stays dead, says so at once
        llm.generate("Hello", GREEDY, use_tqdm=False)
    llm.shutdown()
    assert wait_gone(pids, timeout=10) == []
