"""distributed_executor_backend="uni" (core/uniproc_executor.py): the worker inside the EngineCore
process. Same outputs as worker processes ("mp"), with the steps in flight or without; no child
process; a failure inside the model runner and a killed engine both end as clear errors."""

from __future__ import annotations

import pytest

from minivllm import LLM, EngineDeadError, SamplingParams
from minivllm.core.executor import WorkerDiedError
from minivllm.core.uniproc_executor import UniProcExecutor
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import NewRequestData, SchedulerOutput
from tests.procs import kill_during_generate, pid_alive, wait_gone

PROMPTS = ["Hello", "The scheduler hands out a budget", "One, two, three", "Paged attention reads"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=9, logprobs=2, ignore_eos=True),
          SamplingParams(temperature=1.0, top_p=0.9, seed=9, max_tokens=12, ignore_eos=True)]


def run(model_dir: str, **kwargs) -> list[tuple[list[int], list[dict[int, float]] | None]]:
    """Each request's tokens and, where asked, its logprobs as {token id: logprob} per position."""
    with LLM(model_dir, max_model_len=128, max_num_batched_tokens=32, **kwargs) as llm:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        if kwargs.get("distributed_executor_backend") == "uni":
            assert llm.engine_info.worker_pids == []
        return [(o.outputs[0].token_ids, None if o.outputs[0].logprobs is None else
                 [{t: lp.logprob for t, lp in position.items()} for position in o.outputs[0].logprobs])
                for o in outputs]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_uni_gives_the_outputs_of_worker_processes(tiny_llama, async_scheduling: bool) -> None:
    expected = run(tiny_llama, async_scheduling=async_scheduling)
    got = run(tiny_llama, async_scheduling=async_scheduling, distributed_executor_backend="uni")
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    # Logprobs to float rounding: which requests share a step depends on when they arrive, and
    # fp32 sums over a different batch round differently (as two runs under mp can).
    for (_, ours), (_, theirs) in zip(got, expected):
        assert (ours is None) == (theirs is None)
        for mine, other in zip(ours or [], theirs or []):
            assert mine.keys() == other.keys()
            assert all(abs(mine[t] - other[t]) < 1e-4 for t in mine)


def test_uni_with_speculative_decoding_equals_worker_processes(tiny_llama) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    prompts = [{"prompt_token_ids": [3, 4, 5, 3, 4, 5, 3, 4] * (i + 1)} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def tokens(**kwargs) -> list[list[int]]:
        with LLM(tiny_llama, max_model_len=128, speculative_config=spec, **kwargs) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert tokens(distributed_executor_backend="uni") == tokens()


def test_uni_under_data_parallelism(tiny_llama) -> None:
    """Each of the data-parallel engine cores holds its own worker."""
    prompts = [{"prompt_token_ids": [i + 1, 2, 3]} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def tokens(backend: str) -> list[list[int]]:
        with LLM(tiny_llama, max_model_len=128, data_parallel_size=2, distributed_executor_backend=backend) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert tokens("uni") == tokens("mp")


def test_uni_needs_one_device(tiny_llama) -> None:
    with pytest.raises(ValueError, match="'uni'.*tensor_parallel_size=2"):
        EngineConfig.create(tiny_llama, device="cpu", distributed_executor_backend="uni", tensor_parallel_size=2)


def test_shutdown_leaves_no_process_and_a_killed_engine_is_a_clear_error(tiny_llama) -> None:
    llm = LLM(tiny_llama, max_model_len=512, max_num_batched_tokens=16, distributed_executor_backend="uni")
    engine_pid = llm.engine_info.engine_pid
    assert pid_alive(engine_pid)
    kill_during_generate(llm, engine_pid, match="EngineCore process .* exited")
    with pytest.raises(EngineDeadError):
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    assert wait_gone([engine_pid], timeout=10) == []
    with LLM(tiny_llama, max_model_len=128, distributed_executor_backend="uni") as llm:
        engine_pid = llm.engine_info.engine_pid
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert wait_gone([engine_pid], timeout=10) == []


def test_a_failure_in_the_model_runner_is_a_worker_died_error_with_its_traceback(tiny_llama) -> None:
    config = EngineConfig.create(tiny_llama, device="cpu", distributed_executor_backend="uni", num_gpu_blocks=16,
                                 max_model_len=64)
    executor = UniProcExecutor(config)
    try:
        executor.collective_rpc("initialize_cache", 16)
        with pytest.raises(WorkerDiedError, match="failed in resize_cache"):
            executor.collective_rpc("resize_cache", 8)  # not a method workers offer
        step = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(req_id="a", prompt_token_ids=[1, 2, 3], output_token_ids=[],
                                               sampling_params=SamplingParams(max_tokens=4), block_ids=[0],
                                               num_computed_tokens=0)],
            scheduled_cached_reqs=[], num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3,
            finished_req_ids=[])
        assert len(executor.execute_model(step).sampled_token_ids) == 1

        def broken_step(scheduler_output):
            raise RuntimeError("device lost")

        executor.runner.run_step = broken_step
        with pytest.raises(WorkerDiedError, match="(?s)failed in execute_model.*RuntimeError: device lost"):
            executor.submit(step)
    finally:
        executor.shutdown()
