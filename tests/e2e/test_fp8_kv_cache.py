"""kv_cache_dtype="fp8": its accuracy against the model's own dtype, with bounds.

Greedy agreement is measured teacher-forced, so one early divergence does not decide the score:
a fixed text goes in as a prompt with prompt_logprobs=1 and, at every position, the likeliest next
token under the FP8 cache is compared with the one under the full-precision cache (the greedy
choice there), and the log-probability of the text's actual next token with it (the drift).
The prompt runs in chunks of 64 tokens, so later chunks read their context back from the cache.

Measured here (CPU, float32 model), on TEXT: SmolLM2-135M-Instruct top-1 agreement 95.1%, drift
mean 0.083 nats, max 0.68; tiny random Llama / Qwen3 (near-flat logits, so many near-ties) 90.6% /
91.0%, mean 0.049 / 0.046, max 0.21 / 0.25. On other text SmolLM2 gave 96.4%, mean 0.053; for
scale, running the whole model in bfloat16 instead of float32 gives 99.2%, mean 0.023 there. With
the scales stored as bfloat16 (twenty-fifth session; the CPU box of that day, TEXT): SmolLM2 94.4%,
mean 0.079, max 0.84, against 94.4%, 0.082, 0.98 with float32 scales on the same box; tiny Llama
92.1%, 0.051 against 90.6%, 0.049. The bounds leave room for other text and CPUs, not for a broken
cache: attending over garbage drops agreement to chance.
"""

from __future__ import annotations

import numpy as np
import pytest

from minivllm import LLM, SamplingParams

TEXT = (
    "The history of the Roman Empire spans many centuries. Write a short poem about the sea. "
    "Explain how a CPU cache works: a small, fast memory keeps recently used data close to the core, "
    "so most loads never wait for main memory. def fibonacci(n): return n if n < 2 else "
    "fibonacci(n - 1) + fibonacci(n - 2). The capital of France is Paris, and its river is the Seine. "
    "List three uses of copper: wiring, plumbing and coins. Once upon a time, in a small village, "
    "there lived a baker who rose before dawn. Photosynthesis is the process by which plants turn "
    "light, water and carbon dioxide into sugar and oxygen."
)


def teacher_forced(model: str, kv_cache_dtype: str, prompts: list) -> list:
    with LLM(model, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=64, seed=0) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        return llm.generate(prompts, params, use_tqdm=False)


def compare(model: str, prompts: list) -> tuple[float, float, float]:
    """(top-1 agreement, mean drift, max drift) of fp8 against auto over the prompts' tokens."""
    full, fp8 = teacher_forced(model, "auto", prompts), teacher_forced(model, "fp8", prompts)
    agree, drift = [], []
    for a, b in zip(full, fp8, strict=True):
        assert a.prompt_token_ids == b.prompt_token_ids
        for i in range(1, len(a.prompt_token_ids)):
            rows_a, rows_b = a.prompt_logprobs[i], b.prompt_logprobs[i]
            top_a = max(rows_a.items(), key=lambda kv: kv[1].logprob)[0]
            top_b = max(rows_b.items(), key=lambda kv: kv[1].logprob)[0]
            agree.append(top_a == top_b)
            actual = a.prompt_token_ids[i]
            drift.append(abs(rows_a[actual].logprob - rows_b[actual].logprob))
    return float(np.mean(agree)), float(np.mean(drift)), float(np.max(drift))


def test_fp8_kv_cache_on_smollm2(smollm2_dir: str) -> None:
    agreement, mean_drift, max_drift = compare(smollm2_dir, [TEXT])
    print(f"SmolLM2 fp8 KV: top-1 agreement {agreement:.3f}, drift mean {mean_drift:.4f} max {max_drift:.3f}")
    assert agreement >= 0.92
    assert mean_drift <= 0.12
    assert max_drift <= 1.5


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_fp8_kv_cache_on_tiny_models(tiny_model_factory, arch: str) -> None:
    model = tiny_model_factory(arch)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 200, size=n).tolist()} for n in (150, 90, 40)]
    agreement, mean_drift, max_drift = compare(model, prompts)
    print(f"{arch} fp8 KV: top-1 agreement {agreement:.3f}, drift mean {mean_drift:.4f} max {max_drift:.3f}")
    assert agreement >= 0.80
    assert mean_drift <= 0.10
    assert max_drift <= 0.6


def test_fp8_kv_cache_holds_more_tokens(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same cache memory holds head_dim * element_size / (head_dim + 2) times the blocks in
    FP8 (one byte per element plus a 2-byte scale per vector; about 2x against bfloat16)."""
    import json
    import os

    config = json.load(open(os.path.join(tiny_llama, "config.json")))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    monkeypatch.setenv("MINIVLLM_CPU_KVCACHE_GB", "0.002")
    blocks = {}
    for dtype in ("auto", "fp8"):
        with LLM(tiny_llama, kv_cache_dtype=dtype, max_model_len=512, max_num_seqs=256) as llm:
            blocks[dtype] = llm.engine_info.num_gpu_blocks
    expected = head_dim * 4 / (head_dim + 2)  # the model runs in float32 on the CPU
    assert blocks["fp8"] / blocks["auto"] == pytest.approx(expected, rel=0.02), blocks
