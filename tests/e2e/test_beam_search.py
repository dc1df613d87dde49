"""LLM.beam_search against HF transformers' beam search, token for token, on a tiny random model.

The tiny Llama rarely picks EOS, so the tests use a copy whose EOS row of lm_head is scaled up:
then some hypotheses end in EOS and others run to max_tokens, and both paths are checked.

HF settings that match ours: num_beams = num_return_sequences = beam_width, do_sample=False,
early_stopping="never" (HF's default early_stopping=False stops on a heuristic that can end the
search before a better hypothesis is found; "never" only stops when none can be, as we do).
The length-penalized score is HF's current one (transformers >= 4.50): cum_logprob /
generated_tokens ** length_penalty, EOS counted. Scores are compared with a float32 tolerance
(the engine's kernels sum in another order than HF's); the chosen tokens must be equal, which
holds here because the hypotheses' scores are far apart compared with that error.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from minivllm import LLM, BeamSearchParams, SamplingParams
from minivllm.frontend.beam_search import MAX_BEAM_WIDTH, beam_search_score
from tests.tiny_models import EOS_TOKEN_ID

pytest.importorskip("transformers", minversion="4.50")  # the length penalty formula changed then

PROMPTS = ["Hello", "The quick brown fox", "What is the capital of France?", "Once upon a time"]
VOCAB_SIZE = 512  # tests.tiny_models: the model's vocabulary


@pytest.fixture(scope="module")
def eos_prone_model(tiny_llama, tmp_path_factory) -> str:
    from safetensors.torch import load_file, save_file

    path = str(tmp_path_factory.mktemp("beam") / "eos-prone-llama")
    shutil.copytree(tiny_llama, path)
    weights_file = next(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    weights = load_file(weights_file)
    weights["lm_head.weight"][EOS_TOKEN_ID] *= 3.0
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def llm(eos_prone_model):
    with LLM(eos_prone_model, max_model_len=128) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_model(eos_prone_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(eos_prone_model, dtype=torch.float32).eval()


def hf_beam_search(hf_model, prompt_ids: list[int], width: int, max_tokens: int, length_penalty: float,
                   ignore_eos: bool = False) -> list[tuple[list[int], float]]:
    """HF's best `width` hypotheses (generated tokens, cut after EOS) with their scores."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt_ids]), num_beams=width, num_return_sequences=width, do_sample=False,
            max_new_tokens=max_tokens, early_stopping="never", length_penalty=length_penalty,
            # ignore_eos: an EOS id outside the vocabulary, so EOS (0) is an ordinary token.
            eos_token_id=VOCAB_SIZE if ignore_eos else EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID,
            output_scores=True, return_dict_in_generate=True)
    results = []
    for sequence, score in zip(out.sequences, out.sequences_scores):
        generated = sequence[len(prompt_ids):].tolist()
        if not ignore_eos and EOS_TOKEN_ID in generated:
            generated = generated[: generated.index(EOS_TOKEN_ID) + 1]
        results.append((generated, float(score)))
    return results


def assert_same_as_hf(outputs, expected, length_penalty: float) -> None:
    for prompt_index, (output, hf) in enumerate(zip(outputs, expected)):
        got = [(seq.output_token_ids, beam_search_score(seq.cum_logprob, len(seq.output_token_ids), length_penalty))
               for seq in output.sequences]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in hf], f"prompt {prompt_index}"
        assert [score for _, score in got] == pytest.approx([score for _, score in hf], abs=1e-4)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beam_search_equals_hf_for_several_prompts_at_once(llm, hf_model, length_penalty) -> None:
    params = BeamSearchParams(beam_width=4, max_tokens=10, length_penalty=length_penalty)
    outputs = llm.beam_search(PROMPTS, params)
    tokenizer = llm.get_tokenizer()
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    expected = [hf_beam_search(hf_model, ids, 4, 10, length_penalty) for ids in prompt_ids]
    assert_same_as_hf(outputs, expected, length_penalty)
    finish_reasons = {seq.finish_reason for out in outputs for seq in out.sequences}
    assert finish_reasons == {"stop", "length"}  # both ways of ending are exercised
    for ids, out in zip(prompt_ids, outputs):
        assert len(out.sequences) == 4
        for seq in out.sequences:
            assert seq.tokens[: len(ids)] == ids and seq.num_prompt_tokens == len(ids)  # tokens include the prompt
            assert seq.text == tokenizer.decode(seq.tokens, skip_special_tokens=True)
            assert len(seq.logprobs) == len(seq.output_token_ids)
            assert seq.cum_logprob == pytest.approx(sum(step[t].logprob for step, t in zip(seq.logprobs,
                                                                                          seq.output_token_ids)))
            if seq.finish_reason == "stop":
                assert seq.output_token_ids[-1] == EOS_TOKEN_ID == seq.stop_reason
            else:
                assert len(seq.output_token_ids) == 10 and EOS_TOKEN_ID not in seq.output_token_ids


def test_ignore_eos_runs_every_hypothesis_to_max_tokens(llm, hf_model) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": llm.get_tokenizer()(p).input_ids} for p in PROMPTS[1:3]]  # token-id prompts
    outputs = llm.beam_search(prompts, params)
    expected = [hf_beam_search(hf_model, p["prompt_token_ids"], 3, 8, 1.0, ignore_eos=True) for p in prompts]
    assert_same_as_hf(outputs, expected, 1.0)
    assert all(len(seq.output_token_ids) == 8 and seq.finish_reason == "length"
               for out in outputs for seq in out.sequences)
    # EOS does show up inside the hypotheses, as an ordinary token.
    assert any(EOS_TOKEN_ID in seq.output_token_ids[:-1] for out in outputs for seq in out.sequences)


def test_beam_width_1_is_greedy_and_prompts_do_not_interact(llm) -> None:
    # With length_penalty 0 a hypothesis ended by EOS outranks the one beam that goes on past it
    # (that beam's logprob only falls), so beam_width 1 is greedy. With a positive penalty a
    # longer hypothesis may win instead, in HF's beam search as here; without EOS, all are equal.
    for params, sampling in ((BeamSearchParams(beam_width=1, max_tokens=10, length_penalty=0.0),
                              SamplingParams(temperature=0.0, max_tokens=10)),
                             (BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True),
                              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))):
        greedy = llm.generate(PROMPTS, sampling, use_tqdm=False)
        beams = llm.beam_search(PROMPTS, params)
        assert [out.sequences[0].output_token_ids for out in beams] == [g.outputs[0].token_ids for g in greedy]
        assert [out.sequences[0].finish_reason for out in beams] == [g.outputs[0].finish_reason for g in greedy]
        assert beams[0].sequences[0].cum_logprob == pytest.approx(sum(
            step[t].logprob for step, t in zip(beams[0].sequences[0].logprobs, greedy[0].outputs[0].token_ids)))
    assert {g.outputs[0].finish_reason for g in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10),
                                                             use_tqdm=False)} == {"stop", "length"}
    # One prompt alone gets what it got in the batch.
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    batched = llm.beam_search(PROMPTS, params)
    alone = llm.beam_search(PROMPTS[2], params)
    assert [s.tokens for s in alone[0].sequences] == [s.tokens for s in batched[2].sequences]


def test_beam_search_reuses_the_prefix_cache(llm) -> None:
    llm.reset_prefix_cache()
    before = llm.get_stats()
    llm.beam_search("Once upon a time there was a little language model", BeamSearchParams(beam_width=2, max_tokens=20))
    after = llm.get_stats()
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    assert hits > queries / 2  # each step recomputes only the beams' last, partly filled block


@pytest.mark.parametrize("kwargs, message", [
    (dict(beam_width=0, max_tokens=4), f"beam_width must be in \\[1, {MAX_BEAM_WIDTH}\\]"),
    (dict(beam_width=MAX_BEAM_WIDTH + 1, max_tokens=4), "beam_width must be in"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be >= 1"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be >= 0"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty must be"),
])
def test_beam_search_params_validation(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_bad_prompts_are_value_errors_before_anything_runs(llm) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        llm.beam_search(["fine", ""], params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.beam_search([{"prompt_token_ids": [1, VOCAB_SIZE + 5]}], params)
    with pytest.raises(ValueError, match="no room to generate"):
        llm.beam_search([{"prompt_token_ids": [1] * 128}], params)
    with pytest.raises(TypeError):
        llm.beam_search("fine", SamplingParams())
    assert llm.get_unfinished_request_ids() == []
