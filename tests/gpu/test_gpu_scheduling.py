"""Prefix caching, preemption and the scheduling policies on the CUDA worker (Triton attention,
CUDA graphs): fp32 greedy outputs equal those without prefix caching or preemption. Prefix hits
start requests part-way (num_computed_tokens > 0) and may read blocks that another request of the
same step is writing, which the worker must support."""

from __future__ import annotations

import random

import pytest

from minivllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def shared_prefix_prompts(n: int = 12, seed: int = 0) -> list[dict]:
    """Most prompts start with one 70-token prefix; lengths 71-150."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 400) for _ in range(70)]
    prompts = []
    for i in range(n):
        head = prefix if i % 4 != 3 else [rng.randrange(1, 400) for _ in range(70)]
        prompts.append({"prompt_token_ids": head + [rng.randrange(1, 400) for _ in range(rng.randrange(1, 80))]})
    return prompts


PROMPTS = shared_prefix_prompts()


def run(model_dir: str, one_at_a_time: bool = False, priority=None, **kwargs):
    with LLM(model_dir, device="cuda", dtype="float32", skip_tokenizer_init=True, **kwargs) as llm:
        if one_at_a_time:
            outputs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in PROMPTS]
        else:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=priority)  # fills the prefix cache
            outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=priority)
        return [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs], llm.get_stats()


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    tokens, cached, stats = run(model_dir, one_at_a_time=True, enable_prefix_caching=False)
    assert sum(cached) == 0 and stats.num_preemptions == 0
    return tokens


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_prefix_caching_keeps_greedy_outputs(model_dir, reference, enforce_eager: bool) -> None:
    tokens, cached, stats = run(model_dir, enforce_eager=enforce_eager)
    assert tokens == reference
    assert all(c > 0 for c in cached)  # the second pass hits every prompt's blocks
    assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize(
    "settings",
    [
        dict(enable_prefix_caching=False, max_num_batched_tokens=64),
        dict(max_num_batched_tokens=64),
        dict(scheduling_policy="priority", max_num_batched_tokens=64),
        dict(scheduling_policy="v0"),
    ],
    ids=["no-prefix-caching", "prefix-caching", "priority", "v0"],
)
def test_heavy_preemption_keeps_greedy_outputs(model_dir, reference, settings) -> None:
    priority = [i % 3 for i in range(len(PROMPTS))] if settings.get("scheduling_policy") == "priority" else None
    # 16 blocks of 16 = 256 tokens: about two requests at a time.
    tokens, _, stats = run(model_dir, num_gpu_blocks=16, max_model_len=256, priority=priority, **settings)
    assert tokens == reference
    assert stats.num_preemptions > 0
