"""data_parallel_size=2 with the mp backend: two engine cores behind one frontend.

Both cores serve (the balancer spreads a batch), the tokens are those of one engine, an abort
reaches the core holding the request, stats add up over the cores, and a dead core is a clear
EngineDeadError with no process left behind. (tests/e2e/test_ray.py does DP under Ray.)
"""

from __future__ import annotations

import asyncio

import pytest

from minivllm import LLM, AsyncLLM, EngineDeadError, SamplingParams
from minivllm.frontend.async_llm import run
from tests.procs import kill_during_generate, wait_gone

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(5 * i + j) % 400 + 1 for j in range(n)]} for i, n in enumerate([1, 7, 23, 40, 5, 12])]
ENGINE_ARGS = dict(max_model_len=512, max_num_batched_tokens=32, skip_tokenizer_init=True, device="cpu")


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama) -> list[list[int]]:
    with LLM(tiny_llama, **ENGINE_ARGS) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_dp2_equals_one_engine_and_both_cores_serve(tiny_llama, reference_tokens) -> None:
    with LLM(tiny_llama, data_parallel_size=2, **ENGINE_ARGS) as llm:
        pids = [*llm.client.engine_pids, *llm.engine_info.worker_pids]
        assert len(set(pids)) == 4  # two cores, a worker each
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        per_core = [core.call_utility("get_stats")["num_finished_reqs"] for core in llm.client.cores]
        stats = llm.get_stats()  # the group's: counts add up
    assert tokens == reference_tokens
    assert all(n > 0 for n in per_core) and sum(per_core) == len(PROMPTS) == stats.num_finished_reqs
    assert stats.num_generation_tokens == len(PROMPTS) * GREEDY.max_tokens
    assert wait_gone(pids, timeout=15) == []


def test_async_dp2_equals_one_engine_and_abort_reaches_the_owner(tiny_llama, reference_tokens) -> None:
    long_job = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main(engine: AsyncLLM) -> tuple[list[list[int]], str, int]:
        async def one(request_id: str, prompt, params: SamplingParams):
            async for out in engine.generate(prompt, params, request_id=request_id):
                pass
            return out.outputs[0]

        # Abort the long job once it runs (its first token is out), whatever the CPU's speed: a
        # fixed wait let it reach max_tokens first on a fast box.
        long_stream = engine.generate({"prompt_token_ids": [3, 4, 5]}, long_job, request_id="long")
        aborted = (await anext(long_stream)).outputs[0]
        owners = [i for i, core in enumerate(engine.client.cores) if core.has_request("long")]
        await engine.abort("long")
        async for out in long_stream:
            aborted = out.outputs[0]
        results = await asyncio.gather(*(one(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)))
        # The owning core freed it: nothing is left running anywhere.
        stats = await engine.get_stats()
        assert stats.num_running_reqs == stats.num_waiting_reqs == 0
        assert len(owners) == 1
        return [r.token_ids for r in results], aborted.finish_reason, len(aborted.token_ids)

    with AsyncLLM(tiny_llama, data_parallel_size=2, **ENGINE_ARGS) as engine:
        pids = [*engine.client.engine_pids, *engine.engine_info.worker_pids]
        tokens, finish_reason, num_long_tokens = run(main(engine))
    assert tokens == reference_tokens
    assert finish_reason == "abort" and num_long_tokens < long_job.max_tokens
    assert wait_gone(pids, timeout=15) == []


def test_dead_core_is_engine_dead(tiny_llama) -> None:
    llm = LLM(tiny_llama, data_parallel_size=2, **ENGINE_ARGS)
    pids = [*llm.client.engine_pids, *llm.engine_info.worker_pids]
    victim = llm.client.engine_pids[1]
    kill_during_generate(llm, victim, f"data-parallel engine core 1: .*pid {victim}\\) exited", num_requests=16,
                         within=11)
    with pytest.raises(EngineDeadError):  # and stays dead
        llm.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)
    llm.shutdown()
    assert wait_gone(pids, timeout=15) == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(data_parallel_size=0), "data_parallel_size must be an integer >= 1"),
    (dict(distributed_executor_backend="slurm"), "distributed_executor_backend"),
])
def test_bad_distributed_settings_are_value_errors(tiny_llama, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, device="cpu", **kwargs)
