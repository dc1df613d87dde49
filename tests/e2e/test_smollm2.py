"""The real default model, SmolLM2-135M-Instruct, through the whole engine.

The `smollm2_dir` fixture fetches and converts it into the model cache on a machine's first run
(~40 s); later runs reuse the cached copy.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minivllm import LLM, SamplingParams
from tests.hf_reference import hf_greedy

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a paged KV cache is.",
]


@pytest.fixture(scope="module")
def llm(smollm2_dir: str):
    # A 16-token budget splits every chat prompt (~40 tokens with the default system prompt)
    # into several prefill chunks.
    with LLM(smollm2_dir, max_model_len=512, max_num_batched_tokens=16, dtype="float32", device="cpu") as engine:
        yield engine


def test_greedy_chat_matches_hf_token_for_token(llm, smollm2_dir: str) -> None:
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    prompt_ids = [out.prompt_token_ids for out in outputs]
    assert all(ids[0] == 1 and ids.count(1) == 3 for ids in prompt_ids)  # <|im_start|> x3, no extra BOS
    assert all(len(ids) > 16 for ids in prompt_ids)  # chunked prefill really happened
    expected = hf_greedy(smollm2_dir, prompt_ids, MAX_TOKENS, eos_token_id=llm.engine_info.eos_token_ids[0])
    for question, out, want in zip(QUESTIONS, outputs, expected):
        assert out.outputs[0].token_ids == want, f"{question!r}: differs from HF"


def test_capital_of_france(llm) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended at <|im_end|>, not at max_tokens


def test_readme_command_uses_the_default_model(smollm2_dir: str) -> None:
    """`minivllm generate "What is the capital of France?"`, no --model: the cached default model."""
    command = [sys.executable, os.path.join(REPO_ROOT, "bin", "minivllm"), "generate", "--max-model-len", "512",
               "--max-tokens", str(MAX_TOKENS), "What is the capital of France?"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "<|im_end|>" not in result.stdout
    assert "Downloading" not in result.stderr  # the cached copy was used
