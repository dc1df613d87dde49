"""The CPU decode attention kernel (worker/attention/cpu_decode.py): against the fp32 reference,
through the CPU backend beside prefill chunks, and what stays on SDPA. Skipped where the machine
lacks what a build needs (a C++ compiler, Python's headers, ninja); elsewhere the kernel must build."""

from __future__ import annotations

import os
import shutil
import sysconfig

import pytest
import torch

from minivllm.worker.attention import cpu_decode
from minivllm.worker.attention.cpu_sdpa import SdpaAttentionBackend
from minivllm.worker.attention.kv_cache import KVCacheLayout
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.reference import paged_attention


def _missing_toolchain() -> str | None:
    """What a build needs and this machine lacks (None: it has it all, so the kernel must build)."""
    from torch.utils.cpp_extension import is_ninja_available

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler"
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        return "no Python headers"
    if not is_ninja_available():
        return "no ninja"
    return None


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if cpu_decode.extension() is None:
        missing = _missing_toolchain()
        if missing is not None:
            pytest.skip(f"the kernel cannot be built here: {missing}")
        pytest.fail("the kernel did not build on a machine with a compiler, Python's headers and ninja "
                    "(the log says why)")


def step(query_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int, seed: int) -> AttentionMetadata:
    """A step's metadata: sequences with random, scattered block tables."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = max(-(-n // block_size) for n in seq_lens)
    tables = torch.randperm(num_blocks, generator=g)[: len(seq_lens) * blocks_per_seq].view(len(seq_lens), -1)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             block_tables=tables.to(torch.int32), max_query_len=max(query_lens),
                             slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long), max_seq_len=max(seq_lens))


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (8, 2, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decodes_match_the_fp32_reference(dtype, atol, heads, kv_heads, head_dim, block_size) -> None:
    seq_lens = [1, 2, block_size, block_size + 1, 3 * block_size - 1, 200, 517]
    num_blocks = 256  # (7 sequences of up to 33 blocks of 16)
    layout = KVCacheLayout(block_size, kv_heads, head_dim, dtype)
    g = torch.Generator().manual_seed(heads + block_size)
    cache = torch.randn(layout.shape(num_blocks), generator=g).to(dtype)
    query = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype)
    metadata = step([1] * len(seq_lens), seq_lens, block_size, num_blocks, seed=head_dim)
    scale = head_dim ** -0.5
    assert cpu_decode.supports(query, layout)
    out = torch.full_like(query, float("nan"))
    rows = torch.arange(len(seq_lens))
    cpu_decode.decode_attention(query, layout.split(cache), metadata.block_tables, metadata.seq_lens, rows, rows,
                                scale, out)
    expected = paged_attention(query.float(), cache.float(), metadata, scale)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)


def test_backend_sends_decodes_to_the_kernel_beside_prefill_chunks(monkeypatch) -> None:
    """A mixed step through SdpaAttentionBackend: the decodes' rows from the kernel agree with the
    SDPA path's, the prefill chunks' rows are SDPA's either way."""
    layout = KVCacheLayout(16, 3, 64, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(layout.shape(64), generator=g).to(torch.bfloat16)
    query_lens, seq_lens = [5, 1, 1, 30, 1], [40, 77, 1, 30, 130]
    query = torch.randn(sum(query_lens), 9, 64, generator=g).to(torch.bfloat16)
    metadata = step(query_lens, seq_lens, 16, 64, seed=1)
    with_kernel = SdpaAttentionBackend().attend(query, cache, metadata, 0.125)
    monkeypatch.setattr(cpu_decode, "ENABLED", False)
    without = SdpaAttentionBackend().attend(query, cache, step(query_lens, seq_lens, 16, 64, seed=1), 0.125)
    decode_rows = [5, 6, 37]
    prefill_rows = [r for r in range(sum(query_lens)) if r not in decode_rows]
    assert torch.equal(with_kernel[prefill_rows], without[prefill_rows])
    torch.testing.assert_close(with_kernel[decode_rows].float(), without[decode_rows].float(), atol=1e-2, rtol=0)


def test_what_stays_on_sdpa() -> None:
    query = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    assert cpu_decode.supports(query, KVCacheLayout(16, 2, 64, torch.bfloat16))
    assert not cpu_decode.supports(query.float(), KVCacheLayout(16, 2, 64, torch.float32))  # fp32: exactness runs
    assert not cpu_decode.supports(query, KVCacheLayout(16, 2, 64, torch.bfloat16, fp8=True))  # FP8 cache
    wide = torch.zeros(2, 4, 96, dtype=torch.bfloat16)
    assert not cpu_decode.supports(wide, KVCacheLayout(16, 2, 96, torch.bfloat16))  # head_dim 96: not instantiated


def test_a_bad_call_is_an_error_not_a_crash() -> None:
    layout = KVCacheLayout(16, 2, 64, torch.bfloat16)
    views = layout.split(torch.zeros(layout.shape(4), dtype=torch.bfloat16))
    query = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    rows = torch.zeros(1, dtype=torch.long)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    for args, message in [
        ((tables, lens, rows, rows, 1.0, query.float()), "share one dtype"),
        ((tables, lens, rows, rows[:0], 1.0, query.clone()), "one per decode"),
        ((tables, lens, rows + 1, rows, 1.0, query.clone()), "decode row 1 outside the query"),
        ((tables, lens, rows, rows + 3, 1.0, query.clone()), "sequence 3 outside"),
        ((tables, lens * 17, rows, rows, 1.0, query.clone()), "more than its block table holds"),
        ((tables + 4, lens, rows, rows, 1.0, query.clone()), "block id 4 outside the cache"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            cpu_decode.decode_attention(query, views, *args)


def test_engine_bf16_tokens_with_and_without_the_kernel(tiny_model_factory, monkeypatch) -> None:
    """Through the whole CPU engine in bf16 (a model whose heads the kernel takes): the same greedy
    tokens as with SDPA, whose results it matches to a bf16 rounding."""
    from minivllm import LLM, SamplingParams

    model_dir = tiny_model_factory("qwen3", head_dim=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(13 * i + j) % 300 + 1 for j in range(n)]} for i, n in enumerate([1, 7, 40, 90])]

    def tokens(kernel: str) -> list[list[int]]:
        monkeypatch.setenv("MINIVLLM_CPU_DECODE_KERNEL", kernel)  # the worker process reads it
        with LLM(model_dir, device="cpu", dtype="bfloat16", max_model_len=256) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert tokens("1") == tokens("0")
