"""Decode steps that sample inside a CUDA graph (worker/cuda_graphs.py, "sampling graphs") give the
tokens the eager sampler gives: greedy, seeded and unseeded temperature sampling. A step with a row
that needs the torch sampler (top-p here), logprobs or a logits processor samples eagerly."""

from __future__ import annotations

import numpy as np
import pytest

from minivllm import LLM, SamplingParams
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.worker.model_runner import ModelRunner

PROMPTS = [[(5 * i + j) % 300 + 1 for j in range(n)] for i, n in enumerate([3, 9, 20, 40, 7])]
NUM_STEPS = 12


def run_requests(model_dir: str, params: list[SamplingParams], enforce_eager: bool) -> tuple[list[list[int]], int]:
    """The requests' tokens from a fp32 ModelRunner driven step by step (a prefill step, then decode
    steps of every request), and how many steps sampled eagerly."""
    config = EngineConfig.create(model_dir, device="cuda", dtype="float32", num_gpu_blocks=64, max_num_seqs=8,
                                 max_num_batched_tokens=128, max_model_len=256, enforce_eager=enforce_eager)
    runner = ModelRunner(config)
    runner.initialize_cache(64)
    eager_samples = 0
    sample = runner._sample

    def counted_sample(*args):
        nonlocal eager_samples
        eager_samples += 1
        return sample(*args)

    runner._sample = counted_sample
    ids = [str(i) for i in range(len(PROMPTS))]
    new = [NewRequestData(req_id=r, prompt_token_ids=p, output_token_ids=[], sampling_params=sp,
                          block_ids=list(range(8 * i, 8 * i + 8)), num_computed_tokens=0)
           for i, (r, p, sp) in enumerate(zip(ids, PROMPTS, params))]
    out = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=[],
        num_scheduled_tokens={r: len(p) for r, p in zip(ids, PROMPTS)},
        total_num_scheduled_tokens=sum(map(len, PROMPTS)), finished_req_ids=[]))
    tokens = {r: [t] for r, t in zip(out.req_ids, out.sampled_token_ids)}
    computed = [len(p) for p in PROMPTS]
    for _ in range(NUM_STEPS):
        out = runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=[CachedRequestData(r, [], c) for r, c in zip(ids, computed)],
            num_scheduled_tokens=dict.fromkeys(ids, 1), total_num_scheduled_tokens=len(ids), finished_req_ids=[]))
        for r, t in zip(out.req_ids, out.sampled_token_ids):
            tokens[r].append(t)
        computed = [c + 1 for c in computed]
    return [tokens[r] for r in ids], eager_samples


@pytest.mark.parametrize("kind", ["greedy", "seeded", "unseeded", "mixed"])
def test_decode_steps_sample_in_graphs_as_eager_does(tiny_model_factory, kind: str) -> None:
    model_dir = tiny_model_factory("qwen3")
    params = {
        "greedy": [SamplingParams(temperature=0.0)] * len(PROMPTS),
        "seeded": [SamplingParams(temperature=0.9, seed=7 + i) for i in range(len(PROMPTS))],
        # Unseeded rows draw their Philox seeds from the runner's generator (config.seed): the same
        # draws in the same order both ways.
        "unseeded": [SamplingParams(temperature=1.3)] * len(PROMPTS),
        "mixed": [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3),
                  SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.5)],
    }[kind]
    eager, eager_samples = run_requests(model_dir, params, enforce_eager=True)
    graphs, graph_samples = run_requests(model_dir, params, enforce_eager=False)
    assert graphs == eager
    assert eager_samples == NUM_STEPS + 1
    assert graph_samples == 1  # the prefill step only: every decode step sampled in its graph
    if kind != "greedy":  # sampling, not argmax: the tokens vary
        assert len({t for row in graphs for t in row}) > 10


@pytest.mark.parametrize("special", [dict(top_p=0.9), dict(logprobs=2), dict(repetition_penalty=1.2), dict(min_p=0.1)])
def test_a_row_the_graph_cannot_sample_sends_the_step_to_the_eager_sampler(tiny_model_factory, special) -> None:
    model_dir = tiny_model_factory("qwen3")
    params = [SamplingParams(temperature=0.8, seed=11 + i) for i in range(len(PROMPTS))]
    params[2] = SamplingParams(temperature=0.8, seed=13, **special)
    eager, _ = run_requests(model_dir, params, enforce_eager=True)
    graphs, graph_samples = run_requests(model_dir, params, enforce_eager=False)
    assert graphs == eager
    assert graph_samples == NUM_STEPS + 1


def test_engine_with_sampling_graphs_equals_eager(tiny_model_factory) -> None:
    """End to end through LLM (steps in flight, tokens held back): seeded sampling and greedy."""
    model_dir = tiny_model_factory("llama")
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=20, ignore_eos=True)
              for i in range(6)]
    prompts = [{"prompt_token_ids": (np.arange(1, 4 + 7 * i) % 250 + 1).tolist()} for i in range(6)]

    def generate(**kwargs) -> list[list[int]]:
        with LLM(model_dir, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                 max_num_batched_tokens=256, **kwargs) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert generate() == generate(enforce_eager=True)
