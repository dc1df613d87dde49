"""Pipeline parallelism on the CPU (gloo, mp backend): the layers split over worker processes.

PP=2 must give the tokens one worker gives -- with chunked prefill, preemption and prefix caching
in play, async scheduling on (the default) -- the EngineCore must really keep two batches in
flight (with no request in both), bad sizes must fail before anything starts, and a dead stage
must take the engine down with a clear error and no process left. The Ray backend's PP tests are
in test_pipeline_parallel_ray.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from minivllm import LLM, EngineDeadError, SamplingParams
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import EngineCoreRequest

from tests.procs import wait_gone

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
# Two pairs sharing a 24-token prefix (prefix cache hits), of lengths that chunk at a 32 budget.
SHARED = [(7 * j) % 400 + 1 for j in range(24)]
PROMPTS = [{"prompt_token_ids": ids} for ids in (
    [3], SHARED + [5, 6, 7], [(5 * j) % 400 + 1 for j in range(40)], SHARED + [9] * 11,
    [(11 * j) % 400 + 1 for j in range(17)], SHARED + [8, 1])]
PARAMS = [GREEDY, SEEDED] * (len(PROMPTS) // 2)

# llama: 3 layers (an uneven split: 2 + 1), untied LM head. qwen3: tied embeddings (the last stage
# keeps the embedding for its LM head), q/k norm.
MODELS = {
    "llama-3-layers": ("llama", dict(num_hidden_layers=3)),
    "qwen3-tied": ("qwen3", {}),
}


def generate(model_dir: str, pp: int, tp: int = 1, **engine_args) -> tuple[list[list[int]], dict]:
    """Every prompt's tokens, and the engine's stats; checks the processes are gone afterwards."""
    args = dict(max_model_len=128, max_num_batched_tokens=32, skip_tokenizer_init=True, device="cpu")
    args.update(engine_args)
    with LLM(model_dir, pipeline_parallel_size=pp, tensor_parallel_size=tp, **args) as llm:
        pids = [llm.engine_info.engine_pid, *llm.engine_info.worker_pids]
        assert len(pids) == 1 + pp * tp
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        stats = llm.get_stats()
    assert wait_gone(pids, timeout=10) == []
    return outputs, {"num_preemptions": stats.num_preemptions, "prefix_cache_hits": stats.prefix_cache_hits}


@pytest.mark.parametrize("name", MODELS)
def test_pp2_equals_one_worker(tiny_model_factory, name: str) -> None:
    arch, overrides = MODELS[name]
    model_dir = tiny_model_factory(arch, **overrides)
    tokens, stats = generate(model_dir, 2)
    assert tokens == generate(model_dir, 1)[0]
    assert stats["prefix_cache_hits"] > 0


def test_pp2_with_preemption_equals_one_worker(tiny_model_factory) -> None:
    """A cache of 8 blocks of 16 tokens cannot hold all six requests: some are preempted
    (recomputed later), with batches in flight on both stages."""
    model_dir = tiny_model_factory("llama", num_hidden_layers=3)
    tokens, stats = generate(model_dir, 2, num_gpu_blocks=8, max_model_len=64)
    assert stats["num_preemptions"] > 0
    assert tokens == generate(model_dir, 1, num_gpu_blocks=8, max_model_len=64)[0]


@pytest.mark.slow  # four worker processes on a 2-core box
def test_pp2_tp2_equals_one_worker(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen3")
    assert generate(model_dir, 2, tp=2)[0] == generate(model_dir, 1)[0]


def test_two_batches_in_flight_with_disjoint_requests(tiny_llama) -> None:
    """In-process EngineCore, PP=2: under load it keeps two batches submitted at once (stage 0 on
    the newer while stage 1 is on the older), and no request is in both (its token is not known
    to stage 0 before the older batch comes back). Outputs as with one worker."""
    from minivllm.core.engine_core import EngineCore

    def run(pp: int) -> tuple[dict[str, list[int]], int, int]:
        config = EngineConfig.create(tiny_llama, pipeline_parallel_size=pp, max_model_len=128,
                                     max_num_batched_tokens=256, device="cpu")
        engine = EngineCore(config)
        try:
            for i in range(8):
                engine.add_request(EngineCoreRequest(
                    request_id=f"r{i}", prompt_token_ids=[(3 * i + j) % 400 + 1 for j in range(5 + i)],
                    sampling_params=SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                    arrival_time=0.0, eos_token_ids=[]))
            tokens: dict[str, list[int]] = {}
            overlapped_steps = 0
            while engine.has_work():
                # A step submitted by this step() call went out while the ones in flight before it
                # still were (step() submits first, then receives the oldest).
                before = {s.step_id: set(s.num_scheduled_tokens) for s in engine.steps_in_flight}
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                for new in (s for s in engine.steps_in_flight if s.step_id not in before):
                    if before:
                        overlapped_steps += 1
                    if pp > 1:
                        for old in before.values():
                            assert not old & set(new.num_scheduled_tokens), "a request in two batches at once"
            return tokens, engine.peak_batches_in_flight, overlapped_steps
        finally:
            engine.shutdown()

    tokens, peak, overlapped = run(2)
    assert peak == 2 and overlapped >= 5
    assert tokens == run(1)[0]


@pytest.mark.parametrize("overrides, message", [
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be an integer >= 1"),
    (dict(pipeline_parallel_size=3), "exceeds the model's 2 layers"),
    (dict(pipeline_parallel_size=2, data_parallel_size=2), "with data_parallel_size > 1 is not supported"),
    (dict(pipeline_parallel_size=2, kv_offloading_size=1.0), "with a KV connector"),
])
def test_bad_pipeline_configs_are_value_errors(tiny_llama, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, device="cpu", skip_tokenizer_init=True, **overrides)


@pytest.mark.parametrize("victim", [0, 1])
def test_killed_stage_takes_the_engine_down(tiny_llama, victim: int) -> None:
    """Stage 0 dies (stage 1 waits on a receive that never comes) or stage 1 dies (the answering
    rank): the engine is dead, naming the stage, within seconds; nothing is left running."""
    llm = LLM(tiny_llama, pipeline_parallel_size=2, max_model_len=512, max_num_batched_tokens=16,
              skip_tokenizer_init=True, device="cpu")
    pids = [llm.engine_info.engine_pid, *llm.engine_info.worker_pids]
    victim_pid = llm.engine_info.worker_pids[victim]
    long_job = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    threading.Timer(1.0, os.kill, (victim_pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(EngineDeadError,
                       match=f"worker {victim} \\(pid {victim_pid}, pipeline stage {victim}\\) exited"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 32, long_job, use_tqdm=False)
    assert time.monotonic() - start < 11
    llm.shutdown()
    assert wait_gone(pids, timeout=10) == []
