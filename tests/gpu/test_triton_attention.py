"""The Triton kernels equal the reference paged attention on random mixed batches."""

from __future__ import annotations

import pytest
import torch

from minivllm.worker.attention.metadata import AttentionMetadata, kv_cache_shape
from minivllm.worker.attention.reference import paged_attention as reference_attention
from minivllm.worker.attention.reference import write_kv

pytest.importorskip("triton", reason="needs Triton (the CUDA build of torch)")
from minivllm.worker.attention.triton_attention import paged_attention, store_kv  # noqa: E402

# (context already cached, tokens this step): chunks with and without a prefix, decodes, and
# lengths on and off block boundaries.
MIXED = [(0, 37), (16, 16), (0, 1), (100, 1), (31, 1), (64, 70), (5, 200), (1000, 1), (15, 2)]
DECODES = [(n, 1) for n in (1, 15, 16, 17, 63, 64, 65, 300, 1025)]


def make_batch(cases, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [c + q for c, q in cases]
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 5
    perm = torch.randperm(num_blocks, device="cuda", generator=gen)
    tables = torch.zeros(len(cases), max(blocks) + 2, dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start : start + n]
        start += n
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=gen,
                        device="cuda").to(dtype)
    # The cached prefix: write every sequence's context tokens.
    slots = []
    for i, (context, query) in enumerate(cases):
        pos = torch.arange(context + query, device="cuda")
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    prefix_slots = torch.cat([s[:c] for s, (c, _) in zip(slots, cases)])
    n_prefix = prefix_slots.numel()
    write_kv(torch.randn(n_prefix, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype),
             torch.randn(n_prefix, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype), cache, prefix_slots)
    query_lens = torch.tensor([q for _, q in cases], device="cuda")
    metadata = AttentionMetadata(
        query_start_loc=torch.nn.functional.pad(query_lens.cumsum(0), (1, 0)).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        slot_mapping=torch.cat([s[c:] for s, (c, _) in zip(slots, cases)]),
        max_query_len=max(q for _, q in cases),
        max_seq_len=max(seq_lens),
    )
    num_tokens = int(query_lens.sum())
    q = torch.randn(num_tokens, num_heads, head_dim, device="cuda", generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    return q, k, v, cache, metadata


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads_per_kv", [1, 2, 4, 8])
@pytest.mark.parametrize("cases", [MIXED, DECODES], ids=["mixed", "decode"])
def test_kernel_equals_reference(dtype, head_dim, heads_per_kv, cases, block_size=16) -> None:
    num_kv_heads = 2
    q, k, v, cache, metadata = make_batch(cases, num_kv_heads * heads_per_kv, num_kv_heads, head_dim, block_size,
                                          dtype, seed=head_dim + heads_per_kv)
    expected_cache = cache.clone()
    write_kv(k, v, expected_cache, metadata.slot_mapping)
    store_kv(k, v, cache, metadata.slot_mapping)
    assert torch.equal(cache, expected_cache)

    expected = reference_attention(q.double(), expected_cache.double(), metadata, head_dim**-0.5)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    paged_attention(q, cache, metadata, head_dim**-0.5, out=out)
    assert not out.isnan().any()
    error = (out.double() - expected).norm() / expected.norm()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {error:.2e}"


@pytest.mark.parametrize("block_size", [32, 7])
@pytest.mark.parametrize("cases", [MIXED, DECODES], ids=["mixed", "decode"])
def test_other_block_sizes(cases, block_size) -> None:
    test_kernel_equals_reference(torch.bfloat16, 128, 2, cases, block_size)


def test_padding_rows_write_nothing_and_read_nothing() -> None:
    q, k, v, cache, metadata = make_batch([(10, 1), (20, 1)], 4, 2, 64, 16, torch.bfloat16, seed=0)
    before = cache.clone()
    padded = AttentionMetadata(
        query_start_loc=torch.arange(5, dtype=torch.int32, device="cuda"),
        seq_lens=torch.cat([metadata.seq_lens, torch.zeros(2, dtype=torch.int32, device="cuda")]),
        block_tables=torch.cat([metadata.block_tables, torch.zeros_like(metadata.block_tables)]),
        slot_mapping=torch.cat([metadata.slot_mapping, torch.full((2,), -1, device="cuda")]),
        max_query_len=1, max_seq_len=metadata.max_seq_len,
    )
    pad = lambda t: torch.cat([t, torch.randn_like(t)])  # noqa: E731
    store_kv(pad(k), pad(v), cache, padded.slot_mapping)
    write_kv(k, v, before, metadata.slot_mapping)
    assert torch.equal(cache, before)
    out = paged_attention(pad(q), cache, padded, 0.125)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
