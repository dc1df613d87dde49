"""The CPU offload tier and swap preemption through the public LLM API (real engine and worker
processes, fp32 on CPU): greedy outputs must be token-identical with the tier on and off, under
heavy preemption and prefix-cache churn, and every block must come back."""

from __future__ import annotations

import random
import threading
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.protocol.config import EngineConfig
from tests.procs import StartedEngines

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
BLOCK_SIZE = 4
TINY_CACHE_BLOCKS = 24  # 96 tokens: a few requests at a time
HOST_GIB = 0.001  # about 500 host blocks of the tiny model: far more than the GPU cache


def churn_prompts(seed: int = 0) -> list[dict]:
    """Four 24-token prefixes (6 blocks each), three prompts on each: more prefixes than the tiny
    cache holds, so they are evicted between their users."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 400) for _ in range(24)] for _ in range(4)]
    return [{"prompt_token_ids": prefixes[i % 4] + [rng.randrange(1, 400) for _ in range(1 + rng.randrange(20))]}
            for i in range(12)]


PROMPTS = churn_prompts()


@pytest.fixture(scope="module")
def engines(tiny_llama):
    def start(**kwargs) -> LLM:
        budget = None if kwargs.get("scheduling_policy") == "v0" else 32
        return LLM(tiny_llama, block_size=BLOCK_SIZE, skip_tokenizer_init=True, num_gpu_blocks=TINY_CACHE_BLOCKS,
                   max_num_batched_tokens=budget, **kwargs)

    engines = StartedEngines(start)
    yield engines
    engines.shutdown()


@pytest.fixture(scope="module")
def reference(engines) -> list[list[int]]:
    """Greedy tokens one prompt at a time, no prefix caching, no tier: nothing to get wrong."""
    llm = engines(enable_prefix_caching=False)
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def generate_twice(llm: LLM, priority=None) -> tuple[list[list[int]], list[list[int]], dict]:
    before = llm.get_stats()
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=priority)
    second = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=priority)
    after = llm.get_stats()
    delta = {f: getattr(after, f) - getattr(before, f) for f in ("num_prefill_tokens", "num_preemptions")}
    assert (after.num_running_reqs, after.num_waiting_reqs, after.kv_cache_usage) == (0, 0, 0.0)
    return ([o.outputs[0].token_ids for o in first], [o.outputs[0].token_ids for o in second], delta)


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(preemption_mode="swap"),
        pytest.param(dict(preemption_mode="swap", scheduling_policy="v0"), marks=pytest.mark.slow),
        pytest.param(dict(preemption_mode="swap", scheduling_policy="priority"), marks=pytest.mark.slow),
        pytest.param(dict(preemption_mode="swap", async_scheduling=False), marks=pytest.mark.slow),
        pytest.param(dict(preemption_mode="swap", enable_prefix_caching=False), marks=pytest.mark.slow),
        dict(preemption_mode="swap", distributed_executor_backend="uni"),  # the connector's both sides in one process
    ],
    ids=["offload", "swap", "swap-v0", "swap-priority", "swap-sync", "swap-no-prefix-caching", "swap-uni"],
)
def test_greedy_outputs_identical_with_the_tier_under_preemption_and_churn(engines, reference, settings) -> None:
    priority = [i % 3 for i in range(len(PROMPTS))] if settings.get("scheduling_policy") == "priority" else None
    base = {k: v for k, v in settings.items() if k != "preemption_mode"}
    without = engines(**base)
    with_tier = engines(kv_offloading_size=HOST_GIB, **settings)
    first, second, delta_without = generate_twice(without, priority)
    assert first == second == reference
    first, second, delta_with = generate_twice(with_tier, priority)
    assert first == reference and second == reference
    assert delta_with["num_preemptions"] > 0, "the tiny cache should force preemptions"
    # Spilled prefixes and swapped requests come back instead of being recomputed.
    assert delta_with["num_prefill_tokens"] < delta_without["num_prefill_tokens"]


def test_fp8_cache_blocks_spill_and_swap_unchanged(engines) -> None:
    """kv_cache_dtype="fp8" packs each block's e4m3 bytes and scales into one row; the tier moves
    those rows whole, so outputs with it equal outputs without it (both FP8)."""
    without = engines(kv_cache_dtype="fp8")
    with_tier = engines(kv_cache_dtype="fp8", kv_offloading_size=HOST_GIB, preemption_mode="swap")
    first, second, delta_without = generate_twice(without)
    assert first == second
    first_tier, second_tier, delta_with = generate_twice(with_tier)
    assert first_tier == first and second_tier == first
    assert delta_with["num_preemptions"] > 0
    assert delta_with["num_prefill_tokens"] < delta_without["num_prefill_tokens"]


def test_abort_under_swapping_frees_everything_and_serving_goes_on(engines, reference) -> None:
    llm = engines(kv_offloading_size=HOST_GIB, preemption_mode="swap", scheduling_policy="fcfs")
    long = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)  # the longest prompt + 48 fits
    results: list = []
    thread = threading.Thread(target=lambda: results.extend(llm.generate(PROMPTS, long, use_tqdm=False)))
    before = llm.get_stats().num_preemptions
    thread.start()
    start = time.monotonic()
    while llm.get_stats().num_preemptions < before + 3:  # swapping is under way
        assert time.monotonic() - start < 60 and thread.is_alive()
        time.sleep(0.01)
    ids = sorted(llm.get_unfinished_request_ids(), key=int)
    llm.abort_request(ids[::2])
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert {o.outputs[0].finish_reason for o in results} <= {"abort", "length"}
    assert any(o.outputs[0].finish_reason == "abort" for o in results)
    stats = llm.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)
    # Host blocks of aborted swapped requests came back too: the tier still swaps and serves right.
    first, second, _ = generate_twice(llm)
    assert first == second == reference


def test_kv_transfer_settings_are_validated(tiny_llama) -> None:
    def create(**kwargs) -> EngineConfig:
        return EngineConfig.create(tiny_llama, **kwargs)

    assert create(kv_offloading_size=0.5, preemption_mode="swap").kv_offloading_size == 0.5
    for bad in (0, -1, True, "1"):
        with pytest.raises(ValueError, match="kv_offloading_size"):
            create(kv_offloading_size=bad)
    with pytest.raises(ValueError, match="more than this host's memory"):
        create(kv_offloading_size=1 << 20)
    with pytest.raises(ValueError, match="set kv_offloading_size"):
        create(preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        create(preemption_mode="paging")
    with pytest.raises(ValueError, match="kv_connector must be one of"):
        create(kv_transfer_config={"kv_connector": "NoSuchConnector"})
    with pytest.raises(ValueError, match="kv_role must be one of"):
        create(kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "boss"})
    with pytest.raises(ValueError, match="invalid kv_transfer_config"):
        create(kv_transfer_config={"kv_port": 1})
    with pytest.raises(ValueError, match="needs kv_offloading_size"):
        create(kv_transfer_config={"kv_connector": "OffloadingConnector"})
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        create(kv_offloading_size=0.1, kv_transfer_config={
            "kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"transfer_timeout_s": -1}})
