"""Sampling parameters through the whole engine change outputs as documented."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

PROMPTS = ["Hello", "The quick brown fox", "What is the capital of France?"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, max_model_len=128) as engine:
        yield engine


def tokens(llm, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_top_k_1_equals_greedy(llm) -> None:
    greedy = tokens(llm, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert tokens(llm, SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True, seed=3)) == greedy


def test_repetition_penalty_matches_hf(llm, tiny_llama) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    # Both stop at EOS (id 0), so both outputs end there.
    config = GenerationConfig(max_new_tokens=12, do_sample=False, repetition_penalty=1.5, eos_token_id=0,
                              pad_token_id=0)
    ours = tokens(llm, SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.5))
    plain = tokens(llm, SamplingParams(temperature=0.0, max_tokens=12))
    assert ours != plain  # the penalty changes something
    tokenizer = llm.get_tokenizer()
    for prompt, got in zip(PROMPTS, ours):
        ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), generation_config=config)[0, len(ids):].tolist()
        assert got == expected


def test_logit_bias_steers_and_allowed_token_ids_confine(llm) -> None:
    steered = tokens(llm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={42: 100.0}))
    assert all(t == 42 for out in steered for t in out)
    confined = tokens(llm, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=1,
                                          allowed_token_ids=[5, 6, 7]))
    assert all(t in (5, 6, 7) for out in confined for t in out)


def test_min_tokens_suppresses_stop_tokens(llm) -> None:
    free = tokens(llm, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), PROMPTS[:1])[0]
    stop = free[0]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                  stop_token_ids=[stop], min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert stop not in out.token_ids[:4]
    assert len(out.token_ids) >= 4


def test_presence_and_frequency_penalties_reduce_repeats(llm) -> None:
    plain = tokens(llm, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    penalized = tokens(llm, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                           presence_penalty=2.0, frequency_penalty=2.0))
    repeats = lambda outs: sum(len(o) - len(set(o)) for o in outs)  # noqa: E731
    assert repeats(penalized) < repeats(plain)


@pytest.mark.parametrize("kwargs, message", [
    (dict(logit_bias={600: 1.0}), "logit_bias key 600 is outside the vocabulary"),
    (dict(allowed_token_ids=[1, 999]), "allowed_token_ids entry 999 is outside the vocabulary"),
])
def test_out_of_vocab_ids_are_value_errors(llm, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate("Hello", SamplingParams(**kwargs), use_tqdm=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_p=1.5), "min_p must be in"), (dict(presence_penalty=3.0), "presence_penalty must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
])
def test_sampling_params_validation(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logprobs_match_hf_log_softmax(llm, tiny_llama) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3,
                            repetition_penalty=1.3)  # logprobs are of the raw distribution, penalty or not
    out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    ids = list(out.prompt_token_ids)
    total = 0.0
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
        sampled = position[token_id]
        assert abs(sampled.logprob - expected[token_id].item()) < 1e-4
        assert sampled.rank == int((expected > expected[token_id]).sum()) + 1
        top = expected.topk(3)
        for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert tid in position and abs(position[tid].logprob - lp) < 1e-4
            if tid != token_id:
                assert position[tid].rank == rank
        assert sampled.decoded_token == llm.get_tokenizer().decode([token_id])
        total += sampled.logprob
        ids.append(token_id)
    assert abs(completion.cumulative_logprob - total) < 1e-6
    plain = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_stop_strings_across_tokens(llm) -> None:
    free = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = free.text
    # A stop string that spans a token boundary: two characters around the end of the 4th token.
    cut = len(llm.get_tokenizer().decode(free.token_ids[:4]))
    stop = text[cut - 1 : cut + 1]
    assert len(stop) == 2
    first = text.find(stop)
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:first] and out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(free.token_ids)  # the engine stopped too (aborted by the frontend)
    kept = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                   include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: first + len(stop)]
    assert llm.get_stats().num_running_reqs == 0


def test_stop_strings_need_the_tokenizer_and_must_be_strings(tiny_llama) -> None:
    with pytest.raises(ValueError, match="stop must be a non-empty string"):
        SamplingParams(stop=[""])
    with LLM(tiny_llama, skip_tokenizer_init=True, max_model_len=64) as llm:
        with pytest.raises(ValueError, match="stop strings need the tokenizer"):
            llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(stop="x"), use_tqdm=False)


def test_n_completions_share_the_prompt_and_reproduce(llm) -> None:
    prompt = "A paged attention kernel reads keys and values from fixed-size blocks of memory, so many"
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    first = llm.generate([prompt, "Hello"], params, use_tqdm=False)
    out = first[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.request_id == first[0].request_id
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # samples differ
    assert len(first[1].outputs) == 4
    # The children share the prompt: the prefix cache serves it to all but the first.
    assert out.num_cached_tokens > 0
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    greedy = llm.generate(prompt, SamplingParams(n=2, temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert llm.get_stats().num_running_reqs == 0
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 128\]"):
        SamplingParams(n=0)
