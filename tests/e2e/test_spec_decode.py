"""Speculative decoding through the public LLM API: greedy output token-identical to no
speculation (n-gram and draft model; async scheduling on and off, preemption, prefix caching),
seeded sampling reproducible, acceptance counted, bad settings refused clearly."""

from __future__ import annotations

import random
import time

import pytest

from minivllm import LLM, SamplingParams
from tests.procs import StartedEngines

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def copy_heavy_prompts(n: int = 6, seed: int = 0) -> list[dict]:
    """Prompts that repeat a phrase, sharing a first block or two (so the prefix cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 400) for _ in range(8)]
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(1, 400) for _ in range(rng.randrange(5, 12))]
        prompts.append({"prompt_token_ids": shared + phrase * 3 + phrase[:3]})
    return prompts


PROMPTS = copy_heavy_prompts()


@pytest.fixture(scope="module")
def engines(tiny_llama):
    engines = StartedEngines(lambda model=tiny_llama, **kwargs: LLM(model, block_size=BLOCK_SIZE,
                                                                     skip_tokenizer_init=True, **kwargs))
    yield engines
    engines.shutdown()


@pytest.fixture(scope="module")
def reference(engines) -> list[list[int]]:
    return token_ids(engines().generate(PROMPTS, GREEDY, use_tqdm=False))


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def spec_counters(llm: LLM) -> tuple[int, int, int]:
    stats = llm.get_stats()
    return stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("settings", [
    dict(),  # async scheduling, prefix caching
    dict(async_scheduling=False, enable_prefix_caching=False),
    dict(num_gpu_blocks=24, max_num_batched_tokens=32),  # heavy preemption
], ids=["async-prefix-caching", "sync-no-prefix-caching", "preemption"])
def test_ngram_greedy_is_token_identical(engines, reference, settings) -> None:
    llm = engines(speculative_config=NGRAM, **settings)
    before = llm.get_stats()
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == reference
    after = llm.get_stats()
    drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert drafts > 0 and accepted > 0, "copy-heavy prompts give some accepted drafts"
    assert after.num_generation_tokens - before.num_generation_tokens == sum(map(len, reference))
    if "num_gpu_blocks" in settings:
        assert after.num_preemptions > before.num_preemptions
    else:  # the same prompts again: prefix-cache hits, and still the same tokens
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert token_ids(again) == reference
        if settings.get("enable_prefix_caching", True):
            assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_speculation_steps_aside_above_disable_by_batch_size(engines, tiny_llama, monkeypatch, proposer: str) -> None:
    """Requests of different lengths: the batch shrinks from 6 to 1, so with disable_by_batch_size=3
    steps with and without speculation alternate, the latter with overlapped outputs (forced on, as
    on CUDA: a draft model's catch-up then takes input ids still on the device). The tokens stay
    those of no speculation, and fewer drafts run than with speculation always on. The draft model
    is the target itself: its KV, kept by the catch-up while it steps aside, makes every draft right."""
    monkeypatch.setenv("MINIVLLM_OVERLAP_OUTPUTS", "1")  # inherited by the engines started below
    spec = NGRAM if proposer == "ngram" else {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 2}
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    expected = token_ids(engines().generate(PROMPTS, params, use_tqdm=False))
    drafts = {}
    for limit in (3, None):
        llm = engines(speculative_config=dict(spec, disable_by_batch_size=limit))
        before = spec_counters(llm)
        assert token_ids(llm.generate(PROMPTS, params, use_tqdm=False)) == expected
        num_drafts, num_draft_tokens, num_accepted = (a - b for a, b in zip(spec_counters(llm), before))
        drafts[limit] = num_drafts
        if proposer == "draft_model":
            assert num_accepted == num_draft_tokens > 0
    assert 0 < drafts[3] < drafts[None]


def test_mixed_batch_with_logprobs_penalties_and_stops(engines) -> None:
    """Requests that cannot speculate (logprobs, penalties) share steps with ones that do; stop
    tokens and max_tokens cut accepted drafts exactly where they would without speculation."""
    plain, spec = engines(), engines(speculative_config=NGRAM)
    first = plain.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[first[9]], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    want_lp, got_lp = want[0].outputs[0].logprobs, got[0].outputs[0].logprobs
    assert len(got_lp) == len(want_lp)
    for a, b in zip(got_lp, want_lp):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_seeded_sampling_is_the_same_with_and_without_speculation(engines) -> None:
    """A seeded request draws each position with that position's seed, so speculation (which
    samples the target's token at every verified position) gives the very same tokens."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(PROMPTS))]
    want = token_ids(engines().generate(PROMPTS, params, use_tqdm=False))
    spec = engines(speculative_config=NGRAM)
    assert token_ids(spec.generate(PROMPTS, params, use_tqdm=False)) == want
    assert token_ids(spec.generate(PROMPTS, params, use_tqdm=False)) == want


def test_draft_model_greedy_is_token_identical(engines, reference, tiny_llama, tiny_model_factory) -> None:
    # The target as its own draft: every draft is accepted.
    llm = engines(speculative_config={"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3})
    before = spec_counters(llm)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    drafts, draft_tokens, accepted = (a - b for a, b in zip(spec_counters(llm), before))
    assert draft_tokens > 0 and accepted == draft_tokens
    # Another tiny model with the same vocabulary (other weights, fewer layers): some accepted.
    other = tiny_model_factory("llama", seed=5, num_hidden_layers=1)
    llm = engines(speculative_config={"method": "draft_model", "model": other, "num_speculative_tokens": 2},
                  num_gpu_blocks=40, max_num_batched_tokens=32, async_scheduling=False)
    before = spec_counters(llm)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    drafts, draft_tokens, accepted = (a - b for a, b in zip(spec_counters(llm), before))
    assert draft_tokens > 0 and accepted < draft_tokens


@pytest.mark.parametrize("config, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens'\] must be an integer in \[1, 16\]"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "must be one of ngram, draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min'\] \(4\) must be <= prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, r"in \[1, 64\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_lookahead": 1}, "unknown key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "must be a directory holding config.json"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "integer >= 1"),
])
def test_bad_speculative_config_is_refused(tiny_llama, config, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, skip_tokenizer_init=True, speculative_config=config)


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama, tiny_model_factory) -> None:
    other = tiny_model_factory("llama", seed=1, vocab_size=640)
    with pytest.raises(ValueError, match=r"vocab_size \(640\) differs from the target model's \(512\)"):
        LLM(tiny_llama, skip_tokenizer_init=True,
            speculative_config={"method": "draft_model", "model": other, "num_speculative_tokens": 2})


def test_server_metrics_and_stats_line_show_the_spec_counters(tiny_chat_llama) -> None:
    import json
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from tests.server_procs import ServerProcess

    server = ServerProcess(tiny_chat_llama, "--max-model-len", "256", "--speculative-config", json.dumps(NGRAM),
                           env={"MINIVLLM_STATS_INTERVAL": "0.2"})
    try:
        body = json.dumps({"model": tiny_chat_llama, "prompt": "one two three one two three one two three one two",
                           "max_tokens": 32, "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, sample.labels.get("position"))] = sample.value
        drafts = samples[("minivllm:spec_decode_num_draft_tokens_total", None)]
        accepted = samples[("minivllm:spec_decode_num_accepted_tokens_total", None)]
        assert samples[("minivllm:spec_decode_num_drafts_total", None)] > 0 and drafts > 0
        per_pos = [samples.get(("minivllm:spec_decode_num_accepted_tokens_per_pos_total", str(i)))
                   for i in range(NGRAM["num_speculative_tokens"])]
        assert None not in per_pos and sum(per_pos) == accepted
        deadline = time.monotonic() + 10  # the stats line of the busy interval comes once it is over
        while "SpecDecoding metrics: Mean acceptance length" not in server.output():
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.1)
    finally:
        assert server.stop() == 0, server.output()
