"""Speculative decoding on CUDA (fp32, so greedy ties cannot flip): n-gram and draft-model greedy
outputs equal the CPU reference without speculation, with CUDA graphs (verify steps through the
verify graphs, the draft model's steps through its own) and overlapped outputs between non-speculating steps."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams

# Lengths 12..54: the batch shrinks from 8 requests to 1, so a disable_by_batch_size of 4 sees
# steps where speculation steps aside and steps where it runs.
GREEDY = [SamplingParams(temperature=0.0, max_tokens=12 + 6 * i, ignore_eos=True) for i in range(8)]
PROMPTS = [{"prompt_token_ids": ([3 + i, 17, 29, 41, 53, 67] * 8)[: 20 + 5 * i]} for i in range(8)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def generate(model_dir: str, **kwargs) -> tuple[list[list[int]], object]:
    kwargs = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "skip_tokenizer_init": True, **kwargs}
    with LLM(model_dir, max_model_len=512, **kwargs) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return tokens, llm.get_stats()


@pytest.mark.parametrize("spec", [
    NGRAM,
    dict(NGRAM, disable_by_batch_size=4),  # steps aside while more than 4 run: both paths mix
    "draft_model",
], ids=["ngram", "ngram-steps-aside", "draft-model"])
def test_spec_decode_on_cuda_equals_cpu_reference(tiny_model_factory, spec) -> None:
    model_dir = tiny_model_factory("qwen3")
    expected, _ = generate(model_dir, device="cpu")
    if spec == "draft_model":
        spec = {"method": "draft_model", "model": tiny_model_factory("qwen3", seed=3, num_hidden_layers=1),
                "num_speculative_tokens": 3}
    tokens, stats = generate(model_dir, device="cuda", dtype="float32", speculative_config=spec)
    assert tokens == expected
    assert stats.spec_decode_num_draft_tokens > 0
