"""Pipeline parallelism on CUDA (NCCL send/recv between stages), for a host with at least two GPUs
(nvidia-h200-x2): PP=2 token-identical to one GPU in fp32 (chunked prefill, seeded sampling), a
bf16 smoke run with a clean, quick shutdown, each with the stages eager and as CUDA graphs, and a
killed stage taking the engine down cleanly."""

from __future__ import annotations

import time

import pytest
import torch
from minivllm import LLM, SamplingParams

from tests.procs import kill_during_generate, wait_gone

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA devices")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 400 + 1 for j in range(n)]} for i, n in
           enumerate([1, 5, 17, 33, 64, 100, 129, 250])]


def generate(model_dir: str, params=GREEDY, **kwargs) -> list[list[int]]:
    kwargs = {"max_num_seqs": 16, "max_num_batched_tokens": 512, **kwargs}
    with LLM(model_dir, max_model_len=512, device="cuda", skip_tokenizer_init=True, **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("enforce_eager", [False, True])  # the stages as CUDA graphs / eager
@pytest.mark.parametrize("arch, overrides", [("llama", dict(num_hidden_layers=3)), ("qwen3", {})])
def test_pp2_equals_one_gpu_fp32(tiny_model_factory, arch: str, overrides: dict, enforce_eager: bool) -> None:
    model_dir = tiny_model_factory(arch, **overrides)
    params = [GREEDY, SEEDED] * (len(PROMPTS) // 2)
    expected = generate(model_dir, params, dtype="float32")
    assert generate(model_dir, params, dtype="float32", pipeline_parallel_size=2, enforce_eager=enforce_eager) \
        == expected
    assert generate(model_dir, params, dtype="float32", pipeline_parallel_size=2, max_num_batched_tokens=32,
                    enforce_eager=enforce_eager) == generate(model_dir, params, dtype="float32", max_num_batched_tokens=32)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_pp2_bf16_smoke_and_quick_shutdown(tiny_model_factory, enforce_eager: bool) -> None:
    model_dir = tiny_model_factory("qwen3")
    with LLM(model_dir, max_model_len=512, device="cuda", skip_tokenizer_init=True, pipeline_parallel_size=2,
             max_num_seqs=16, max_num_batched_tokens=512, enforce_eager=enforce_eager) as llm:
        pids = [llm.engine_info.engine_pid, *llm.engine_info.worker_pids]
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        start = time.monotonic()
    assert wait_gone(pids, timeout=15) == []
    assert time.monotonic() - start < 4
    assert [len(o) for o in outputs] == [GREEDY.max_tokens] * len(PROMPTS)


@pytest.mark.parametrize("victim", [0, 1])
def test_killed_stage_takes_the_engine_down(tiny_llama, victim: int) -> None:
    llm = LLM(tiny_llama, pipeline_parallel_size=2, device="cuda", max_model_len=512, max_num_batched_tokens=16,
              max_num_seqs=8, skip_tokenizer_init=True)
    pids = [llm.engine_info.engine_pid, *llm.engine_info.worker_pids]
    victim_pid = llm.engine_info.worker_pids[victim]
    kill_during_generate(llm, victim_pid, f"worker {victim} \\(pid {victim_pid}, pipeline stage {victim}\\)",
                         num_requests=64, max_tokens=480, delay=2.0)
    llm.shutdown()
    assert wait_gone(pids, timeout=15) == []
