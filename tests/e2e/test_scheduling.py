"""Scheduler features through the public LLM API: prefix caching, preemption, policies, limits,
abort and stats. Greedy outputs must not depend on any of them."""

from __future__ import annotations

import random
import threading
import time

import pytest

from minivllm import LLM, SamplingParams
from tests.procs import StartedEngines

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
BLOCK_SIZE = 4
TINY_CACHE_BLOCKS = 24  # 96 tokens: a few requests at a time, so heavy preemption


def shared_prefix_prompts(n: int = 8, seed: int = 0) -> list[dict]:
    """Token-id prompts, most starting with one 24-token prefix (6 blocks), each 20-45 tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 400) for _ in range(24)]
    prompts = []
    for i in range(n):
        suffix = [rng.randrange(1, 400) for _ in range(rng.randrange(1, 22))]
        ids = (prefix if i % 4 != 3 else [rng.randrange(1, 400) for _ in range(20)]) + suffix
        prompts.append({"prompt_token_ids": ids})
    return prompts


PROMPTS = shared_prefix_prompts()
PROMPT_LENS = [len(p["prompt_token_ids"]) for p in PROMPTS]


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """engines(**kwargs) -> an LLM with those settings, started once per module."""
    engines = StartedEngines(lambda **kwargs: LLM(tiny_llama, block_size=BLOCK_SIZE, skip_tokenizer_init=True,
                                                  **kwargs))
    yield engines
    engines.shutdown()


def tiny_cache_engine(engines, **settings) -> LLM:
    """An engine whose KV cache holds a few requests at a time. v0 prefills whole prompts, so it
    keeps its default budget (>= max_model_len); the others get a small one and chunk prompts."""
    budget = None if settings.get("scheduling_policy") == "v0" else 32
    return engines(num_gpu_blocks=TINY_CACHE_BLOCKS, max_num_batched_tokens=budget, **settings)


@pytest.fixture(scope="module")
def reference(engines) -> list[list[int]]:
    """Greedy tokens without prefix caching or preemption: one prompt at a time (each fits)."""
    llm = tiny_cache_engine(engines, enable_prefix_caching=False)
    outputs, delta = stats_delta(llm, lambda: [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in PROMPTS])
    assert delta["num_preemptions"] == 0
    # Without prefix caching every prompt token is computed, every time.
    assert [o.num_cached_tokens for o in outputs] == [0] * len(PROMPTS)
    assert delta["num_prefill_tokens"] == sum(PROMPT_LENS)
    return token_ids(outputs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def stats_delta(llm: LLM, run):
    before = llm.get_stats()
    result = run()
    after = llm.get_stats()
    return result, {
        field: getattr(after, field) - getattr(before, field)
        for field in ("num_prefill_tokens", "num_generation_tokens", "num_preemptions", "prefix_cache_hits")
    }


# ---------------------------------------------------------------- prefix caching


def test_shared_prefix_batch_hits_the_cache_and_computes_fewer_tokens(engines, reference) -> None:
    llm = engines()  # prefix caching on by default
    assert llm.reset_prefix_cache() is True
    outputs, delta = stats_delta(llm, lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert token_ids(outputs) == reference
    cached = [o.num_cached_tokens for o in outputs]
    assert sum(cached) > 0 and all(c % BLOCK_SIZE == 0 for c in cached)
    # Every prompt token is computed once, except the cached ones; no preemption here.
    assert delta["num_preemptions"] == 0
    assert delta["num_prefill_tokens"] == sum(PROMPT_LENS) - sum(cached)
    assert delta["prefix_cache_hits"] == sum(cached)

    # The same batch again: everything but each prompt's last block comes from the cache.
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(again) == reference
    assert [o.num_cached_tokens for o in again] == [(n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in PROMPT_LENS]


def test_reset_prefix_cache_and_cache_salt(engines, reference) -> None:
    llm = engines()
    prompt = PROMPTS[0]
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == reference[0]

    salted = {**prompt, "cache_salt": "tenant-a"}
    out = llm.generate(salted, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0, "another salt must not see the unsalted blocks"
    assert llm.generate(salted, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    out = llm.generate({**prompt, "cache_salt": "tenant-b"}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference[0]


# ---------------------------------------------------------------- preemption and policies


@pytest.mark.parametrize(
    "settings",
    [
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True),
        dict(scheduling_policy="priority"),
        dict(scheduling_policy="v0"),
        dict(async_scheduling=False),
    ],
    ids=["no-prefix-caching", "prefix-caching", "priority", "v0", "sync-scheduling"],
)
def test_greedy_outputs_unchanged_under_heavy_preemption(engines, reference, settings) -> None:
    llm = tiny_cache_engine(engines, **settings)
    priority = [i % 3 for i in range(len(PROMPTS))] if settings.get("scheduling_policy") == "priority" else None
    outputs, delta = stats_delta(llm, lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=priority))
    assert token_ids(outputs) == reference
    assert delta["num_preemptions"] > 0, "the tiny cache should force preemptions"
    assert delta["num_generation_tokens"] == GREEDY.max_tokens * len(PROMPTS)
    stats = llm.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


def test_priority_needs_the_priority_policy(engines) -> None:
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        engines().generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="one per prompt"):
        tiny_cache_engine(engines, scheduling_policy="priority").generate(PROMPTS[:2], GREEDY, use_tqdm=False,
                                                                          priority=[0])


def test_request_that_could_never_fit_is_rejected_and_the_engine_keeps_serving(engines, reference) -> None:
    llm = tiny_cache_engine(engines, enable_prefix_caching=True)
    too_long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)  # 24+ prompt + 80 > 96
    with pytest.raises(ValueError, match="more than the whole KV cache holds"):
        llm.generate(PROMPTS[0], too_long, use_tqdm=False)
    with pytest.raises(ValueError, match="more than the whole KV cache holds"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=None), use_tqdm=False)  # may reach max_model_len
    assert token_ids(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == reference[:2]


# ---------------------------------------------------------------- abort and stats


def test_abort_from_another_thread_frees_the_blocks(tiny_llama, monkeypatch, capfd) -> None:
    monkeypatch.setenv("MINIVLLM_STATS_INTERVAL", "0.05")  # the spawned engine logs stats often
    # Three requests too long to finish before the abort (a tiny model on a fast CPU makes ~1 token
    # per ms: 460 tokens last about half a second, the most the 96-block cache holds for three), and
    # a short fourth that waits for a seat.
    params = [SamplingParams(temperature=0.0, max_tokens=460, ignore_eos=True)] * 3 + [GREEDY]
    # block_size 16: the CPU reference attention walks a sequence block by block.
    with LLM(tiny_llama, skip_tokenizer_init=True, max_num_seqs=3) as llm:
        results: list = []
        worker = threading.Thread(target=lambda: results.extend(llm.generate(PROMPTS[:4], params, use_tqdm=False)))
        worker.start()
        start = time.monotonic()
        # get_stats from this thread while generate() holds the client in the other one. Wait
        # long enough for a timed stats line to catch the three running.
        while llm.get_stats().num_generation_tokens < 20 or time.monotonic() - start < 0.2:
            assert time.monotonic() - start < 30
            time.sleep(0.05)
        ids = llm.get_unfinished_request_ids()
        assert len(ids) == 4
        running = llm.get_stats()
        assert (running.num_running_reqs, running.num_waiting_reqs) == (3, 1)  # max_num_seqs=3
        llm.abort_request(sorted(ids, key=int)[:3])  # the three running ones: the fourth gets a seat
        worker.join(timeout=60)
        assert not worker.is_alive()

        reasons = [o.outputs[0].finish_reason for o in results]
        assert reasons == ["abort", "abort", "abort", "length"]
        assert all(0 < len(o.outputs[0].token_ids) < 460 for o in results[:3])
        assert len(results[3].outputs[0].token_ids) == 16
        stats = llm.get_stats()
        assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)

        # Aborting finished or unknown ids is harmless; the engine keeps serving.
        llm.abort_request(ids + ["no-such-request"])
        llm.abort_request("0")
        assert len(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 16
        llm.log_stats()
    err = capfd.readouterr().err
    assert "Avg prompt throughput" in err and "Prefix cache hit rate" in err and "Preemptions" in err
    assert "Running: 3 reqs" in err  # a line logged on the timer while the requests ran
