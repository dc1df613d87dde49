"""Greedy outputs of the whole multi-process engine are token-identical to HF transformers (fp32)."""

from __future__ import annotations

import random

import pytest

from minivllm import LLM, SamplingParams
from tests.hf_reference import hf_greedy
from tests.tiny_models import EOS_TOKEN_ID

MAX_TOKENS = 24
TEXT_PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "A paged attention kernel reads keys and values from fixed-size blocks of memory, so many "
    "sequences can share one cache without fragmentation. The scheduler hands out a budget.",
    "Peter",
    "She sells sea shells by the sea shore and then",
    "In the beginning the engine was small",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 and onwards, counting up: 11 12 13 14 15 16 17 18 19 20",
]


def random_id_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 400) for _ in range(rng.randrange(1, 70))] for _ in range(n)]


# (max_num_batched_tokens, block_size, max_num_seqs): a large budget; a budget so small that
# prompts are split into many chunks (and odd blocks); few seats so requests queue.
ENGINE_SHAPES = {
    "large-budget": (2048, 16, 256),
    "tiny-chunks": (7, 5, 256),
    "queued": (40, 16, 3),
}


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_greedy_matches_hf(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    shapes = ENGINE_SHAPES if arch == "llama" else {k: ENGINE_SHAPES[k] for k in ("large-budget", "tiny-chunks")}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected_by_prompt: list[list[int]] | None = None
    for shape, (budget, block_size, max_seqs) in shapes.items():
        with LLM(model_dir, max_num_batched_tokens=budget, block_size=block_size, max_num_seqs=max_seqs) as llm:
            if expected_by_prompt is None:
                tokenizer = llm.get_tokenizer()
                prompt_ids = [tokenizer(p).input_ids for p in TEXT_PROMPTS] + random_id_prompts(4, seed=1)
                expected_by_prompt = hf_greedy(model_dir, prompt_ids, MAX_TOKENS, EOS_TOKEN_ID)
            prompts = TEXT_PROMPTS + [{"prompt_token_ids": ids} for ids in prompt_ids[len(TEXT_PROMPTS):]]
            outputs = llm.generate(prompts, params, use_tqdm=False)
        assert len(outputs) == len(prompts) >= 8
        for i, (out, expected) in enumerate(zip(outputs, expected_by_prompt)):
            assert out.prompt_token_ids == prompt_ids[i]
            assert out.outputs[0].token_ids == expected, f"{arch}/{shape}: prompt {i} differs from HF"
            reason = "stop" if expected[-1] == EOS_TOKEN_ID and len(expected) <= MAX_TOKENS else "length"
            assert out.outputs[0].finish_reason == reason
