"""What comes back: prompt_logprobs (against HF, across prefill chunks), bad_words,
detokenize / skip_special_tokens, and finish_reason / stop_reason as vLLM reports them."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.protocol.sampling_params import MAX_LOGPROBS
from tests.tiny_models import EOS_TOKEN, EOS_TOKEN_ID

LOGPROB_TOL = 1e-4  # fp32 on both sides; observed differences are ~1e-6


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # A 7-token budget with 5-token blocks: every prompt here is prefilled in several chunks, whose
    # boundaries fall inside blocks.
    with LLM(tiny_llama, max_model_len=128, max_num_batched_tokens=7, block_size=5) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def greedy(llm, prompt, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=kwargs.pop("max_tokens", 24), **kwargs)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


# ---------------------------------------------------------------- prompt_logprobs


def test_prompt_logprobs_match_hf_across_chunks(llm, hf_model) -> None:
    prompts = ["The quick brown fox jumps over the lazy dog while the scheduler hands out a budget",
               "Hello", "Paris is the capital of France. Berlin is the capital of Germany."]
    k = 3
    # Warm the prefix cache with the first prompt: a request asking for prompt logprobs must not use it.
    llm.generate(prompts[0], SamplingParams(max_tokens=1), use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k),
              SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=2)]  # shares the batch, asks nothing
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert outputs[2].prompt_logprobs is None
    assert outputs[0].num_cached_tokens == 0  # skipped the warm cache
    tokenizer = llm.get_tokenizer()
    for out, num_top in zip(outputs[:2], (k, 0)):
        ids = out.prompt_token_ids
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        with torch.no_grad():
            expected = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        for j in range(1, len(ids)):
            position, row = out.prompt_logprobs[j], expected[j - 1]
            token = position[ids[j]]
            assert abs(token.logprob - row[ids[j]].item()) < LOGPROB_TOL
            assert token.rank == int((row > row[ids[j]]).sum()) + 1
            assert token.decoded_token == tokenizer.decode([ids[j]])
            top = row.topk(num_top)
            for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
                assert abs(position[tid].logprob - lp) < LOGPROB_TOL
                if tid != ids[j]:
                    assert position[tid].rank == rank
            assert len(position) in (num_top, num_top + 1)
    # The same greedy continuation as without prompt logprobs.
    assert outputs[0].outputs[0].token_ids == greedy(llm, prompts[0], max_tokens=2).token_ids


def test_prompt_logprobs_of_n_completions_and_streams_validation(llm) -> None:
    out = llm.generate("Hello world", SamplingParams(n=2, max_tokens=2, prompt_logprobs=1, seed=1),
                       use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    for bad in (-1, MAX_LOGPROBS + 1):
        with pytest.raises(ValueError, match=rf"prompt_logprobs must be an integer in \[0, {MAX_LOGPROBS}\]"):
            SamplingParams(prompt_logprobs=bad)


# ---------------------------------------------------------------- bad_words


def test_single_token_bad_word_is_never_generated(llm) -> None:
    prompt = "The quick brown fox"
    free = greedy(llm, prompt, ignore_eos=True)
    tokenizer = llm.get_tokenizer()
    # "Fr" at the start of the text and " Fr" mid-text are one token each: both are banned.
    banned = {tokenizer.encode("Fr", add_special_tokens=False)[0], tokenizer.encode(" Fr", add_special_tokens=False)[0]}
    first = next(i for i, t in enumerate(free.token_ids) if t in banned)  # the word appears when allowed
    out = greedy(llm, prompt, ignore_eos=True, bad_words=["Fr"])
    assert not banned & set(out.token_ids)  # ... and never when banned
    assert out.token_ids[:first] == free.token_ids[:first] and out.token_ids[first] != free.token_ids[first]
    # As in vLLM, bad words are token sequences: " France" is a token of its own and stays allowed.
    assert "Fr" in free.text.replace("France", "") and "Fr" not in out.text.replace("France", "")


def test_multi_token_bad_word_bans_only_its_last_token_after_its_prefix(llm) -> None:
    prompt = "What is the capital of France?"
    free = greedy(llm, prompt, ignore_eos=True)
    assert " is is" in free.text
    out = greedy(llm, prompt, ignore_eos=True, bad_words=["is is"])
    assert " is is" not in out.text
    is_id = llm.get_tokenizer().encode(" is", add_special_tokens=False)[0]
    assert is_id in out.token_ids  # " is" alone is still allowed
    assert all((a, b) != (is_id, is_id) for a, b in zip(out.token_ids, out.token_ids[1:]))


# ---------------------------------------------------------------- detokenize, special tokens


def test_detokenize_false_gives_token_ids_only(llm) -> None:
    prompt = "Once upon a time"
    text_on = greedy(llm, prompt, logprobs=1, max_tokens=8)
    text_off = greedy(llm, prompt, logprobs=1, max_tokens=8, detokenize=False)
    assert text_on.text and text_off.text == ""
    assert text_off.token_ids == text_on.token_ids
    assert all(lp.decoded_token is None for position in text_off.logprobs for lp in position.values())
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(detokenize=False, stop=["x"])


def test_skip_special_tokens(llm) -> None:
    # A big bias on EOS with ignore_eos: the output is EOS tokens, which the text hides by default.
    kwargs = dict(ignore_eos=True, max_tokens=3, logit_bias={EOS_TOKEN_ID: 100.0})
    assert greedy(llm, "Hello", **kwargs).token_ids == [EOS_TOKEN_ID] * 3
    assert greedy(llm, "Hello", **kwargs).text == ""
    assert greedy(llm, "Hello", skip_special_tokens=False, **kwargs).text == EOS_TOKEN * 3


# ---------------------------------------------------------------- finish_reason / stop_reason


def test_finish_and_stop_reasons(llm) -> None:
    prompt = "What is the capital of France?"
    free = greedy(llm, prompt, ignore_eos=True)
    assert (free.finish_reason, free.stop_reason) == ("length", None)
    # EOS: "stop" with no stop_reason. This prompt's greedy output reaches EOS (id 0) at token 11.
    eos = greedy(llm, prompt)
    assert eos.token_ids[-1] == EOS_TOKEN_ID and (eos.finish_reason, eos.stop_reason) == ("stop", None)
    # A stop token: "stop" with the token id; the token is in token_ids but not in the text.
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    by_token = greedy(llm, prompt, ignore_eos=True, stop_token_ids=[stop_id])
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", stop_id)
    assert by_token.token_ids == free.token_ids[: first + 1]
    tokenizer = llm.get_tokenizer()
    assert by_token.text == tokenizer.decode(free.token_ids[:first])
    kept = greedy(llm, prompt, ignore_eos=True, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert kept.text == tokenizer.decode(free.token_ids[: first + 1])
    # A stop string: "stop" with the string.
    by_string = greedy(llm, prompt, ignore_eos=True, stop=[" is"])
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", " is")
