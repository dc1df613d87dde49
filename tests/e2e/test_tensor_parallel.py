"""Tensor parallelism on the CPU (gloo): two worker processes, one sharded model.

TP=2 must give the tokens TP=1 gives (the tiny models' peaked logits keep the all-reduce's
different summation order from flipping a token), a bad size must fail before anything starts,
and a worker that dies must take the engine down with a clear error and no process left.
"""

from __future__ import annotations

import time

import pytest

from minivllm import LLM, SamplingParams
from tests.procs import kill_during_generate, wait_gone

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(5 * i + j) % 400 + 1 for j in range(n)]} for i, n in enumerate([1, 7, 23, 40])]

# Each covers what the other does not:
#   llama: 1 KV head for 2 ranks (replicated), vocab 511 (padded to 2 x 256), untied LM head,
#          o_proj / down_proj biases (added once, by rank 0)
#   qwen3: 2 KV heads split, tied embeddings (the LM head is the embedding's shard), q/k norm
MODELS = {
    "llama-kv1-vocab511-bias": ("llama", dict(num_key_value_heads=1, vocab_size=511, attention_bias=True,
                                              mlp_bias=True)),
    "qwen3-tied": ("qwen3", {}),
}


def generate(model_dir: str, tensor_parallel_size: int) -> list[list[int]]:
    """Greedy and seeded outputs; also checks the engine's processes are gone soon after it shuts down."""
    # A small budget: prompts are chunked, so prefill chunks and decodes share steps.
    with LLM(model_dir, tensor_parallel_size=tensor_parallel_size, max_model_len=128,
             max_num_batched_tokens=32, skip_tokenizer_init=True) as llm:
        pids = [llm.engine_info.engine_pid, *llm.engine_info.worker_pids]
        assert len(pids) == 1 + tensor_parallel_size
        params = [GREEDY, SEEDED] * (len(PROMPTS) // 2)
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        start = time.monotonic()
    assert wait_gone(pids, timeout=10) == []
    if tensor_parallel_size > 1:  # every rank takes the Shutdown: none waits out stop_child's 5 s
        assert time.monotonic() - start < 4
    return outputs


@pytest.mark.parametrize("name", MODELS)
def test_tp2_equals_tp1(tiny_model_factory, name: str) -> None:
    arch, overrides = MODELS[name]
    model_dir = tiny_model_factory(arch, **overrides)
    assert generate(model_dir, 2) == generate(model_dir, 1)


@pytest.mark.parametrize("size, message", [(0, ">= 1"), (3, "one of 1, 2, 4"), (8, "one of 1, 2, 4")])
def test_bad_tensor_parallel_size_is_a_value_error(tiny_llama, size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, tensor_parallel_size=size, device="cpu")


def test_killed_worker_takes_the_engine_down(tiny_llama) -> None:
    """Rank 1 dies: rank 0, the one that answers, is left inside a broken all-reduce
    (tests/gpu kills each rank in turn)."""
    victim = 1
    llm = LLM(tiny_llama, tensor_parallel_size=2, max_model_len=512, max_num_batched_tokens=16,
              skip_tokenizer_init=True)
    pids = [llm.engine_info.engine_pid, *llm.engine_info.worker_pids]
    victim_pid = llm.engine_info.worker_pids[victim]
    # The dead rank is named, not its sibling whose all-reduce broke.
    kill_during_generate(llm, victim_pid, f"worker {victim} \\(pid {victim_pid}\\) exited", within=11)
    llm.shutdown()
    assert wait_gone(pids, timeout=10) == []
