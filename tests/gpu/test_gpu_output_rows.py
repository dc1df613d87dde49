"""A prefill step's last layer run for its sampled rows alone (worker/output_rows.py) on CUDA: a
long prompt in chunks (the Hopper kernel's steps, where the shortcut counts) and short prompts
beside decodes give the tokens and logprobs of the whole last layer."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
# bf16: the sampled row's attention comes from the decode kernel instead of the prefill kernel's
# last row, which rounds differently here and there.
BF16_LOGPROB_TOLERANCE = 0.05


def run(model_dir: str, **kwargs) -> list:
    prompts = [{"prompt_token_ids": [(13 * j) % 500 + 1 for j in range(9000)]}]
    prompts += [{"prompt_token_ids": [(7 * i + j) % 400 + 1 for j in range(n)]} for i, n in enumerate([3, 40, 700])]
    with LLM(model_dir, device="cuda", max_model_len=10000, max_num_seqs=8, max_num_batched_tokens=4096,
             **kwargs) as llm:
        return [o.outputs[0] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


# fp32 eagerly (the same tokens throughout), bf16 with CUDA graphs (the prompt steps over 8k tokens
# run eagerly beside them: the Hopper kernel's)
@pytest.mark.parametrize("dtype,enforce_eager", [("float32", True), ("bfloat16", False)])
def test_last_layer_on_sampled_rows_samples_as_the_whole_layer(monkeypatch, tiny_model_factory, dtype: str,
                                                               enforce_eager: bool) -> None:
    model_dir = tiny_model_factory("qwen3", head_dim=128, max_position_embeddings=10000)
    outputs = run(model_dir, dtype=dtype, enforce_eager=enforce_eager)
    monkeypatch.setenv("MINIVLLM_LAST_LAYER_ALL_ROWS", "1")  # (read by the worker processes at start)
    whole = run(model_dir, dtype=dtype, enforce_eager=enforce_eager)
    tolerance = 1e-4 if dtype == "float32" else BF16_LOGPROB_TOLERANCE
    for mine, theirs in zip(outputs, whole, strict=True):
        assert mine.token_ids[0] == theirs.token_ids[0]
        first, first_whole = mine.logprobs[0], theirs.logprobs[0]
        shared = first.keys() & first_whole.keys()  # (bf16: a near-tie may swap the fifth)
        assert mine.token_ids[0] in shared and len(shared) >= 4
        for token_id in shared:
            assert first[token_id].logprob == pytest.approx(first_whole[token_id].logprob, abs=tolerance)
        if dtype == "float32":
            assert mine.token_ids == theirs.token_ids
