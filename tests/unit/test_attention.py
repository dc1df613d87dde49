"""The CPU paged-attention backends (the reference and SDPA) equal plain causal attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.worker.attention.cpu_sdpa import SdpaAttentionBackend
from minivllm.worker.attention.kv_cache import FP8_MAX, KVCacheLayout, dequantize, quantize
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.reference import ReferenceAttentionBackend, write_kv

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
BACKENDS = {"reference": ReferenceAttentionBackend, "cpu-sdpa": SdpaAttentionBackend}


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_queries: int) -> torch.Tensor:
    """q/k/v [seq_len, heads, dim] for one whole sequence; the output of its last num_queries tokens."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=HEAD_DIM**-0.5
    )
    return out.transpose(0, 1)[-num_queries:]


def run_case(backend: str, context_lens: list[int], query_lens: list[int], block_size: int, seed: int,
             fp8: bool = False) -> None:
    """Sequence i has context_lens[i] tokens already cached and runs query_lens[i] new ones.
    fp8: an FP8 cache; the output must then equal attention over the quantized-and-dequantized K/V."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7  # some blocks nobody owns
    # Random, non-contiguous block assignment.
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_ids, start = [], 0
    for n in blocks_per_seq:
        block_ids.append(perm[start : start + n])
        start += n
    max_blocks = max(blocks_per_seq) + 1  # one column of padding for everyone
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, ids in enumerate(block_ids):
        block_tables[i, : len(ids)] = torch.tensor(ids)

    def slots(i: int, positions: range) -> list[int]:
        return [block_ids[i][p // block_size] * block_size + p % block_size for p in positions]

    # NaN in every slot nobody writes (block tails, padding columns, free blocks): masked
    # slots must never leak into the output.
    layout = KVCacheLayout(block_size, NUM_KV_HEADS, HEAD_DIM, torch.float32, fp8=fp8)
    kv_cache = layout.allocate(num_blocks, torch.device("cpu"))
    kv_cache.fill_(0xFF if fp8 else float("nan"))  # 0xFF bytes: NaN as e4m3 data and as bfloat16 scales

    full_q, full_k, full_v = [], [], []
    for i, n in enumerate(seq_lens):
        full_q.append(torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen))
        full_k.append(torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen))
        full_v.append(torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen))
        # The cached prefix is already in the cache from earlier steps.
        if context_lens[i]:
            prefix_slots = torch.tensor(slots(i, range(context_lens[i])))
            write_kv(full_k[i][: context_lens[i]], full_v[i][: context_lens[i]], kv_cache, prefix_slots, layout)

    # This step's packed batch: the last query_lens[i] tokens of each sequence.
    q = torch.cat([full_q[i][c:] for i, c in enumerate(context_lens)])
    k = torch.cat([full_k[i][c:] for i, c in enumerate(context_lens)])
    v = torch.cat([full_v[i][c:] for i, c in enumerate(context_lens)])
    slot_mapping = torch.tensor([s for i, c in enumerate(context_lens) for s in slots(i, range(c, seq_lens[i]))])
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        kv_layout=layout,
    )
    out = BACKENDS[backend]().forward(q, k, v, kv_cache, metadata, HEAD_DIM**-0.5)
    if fp8:  # what the cache holds
        full_k = [dequantize(*quantize(x), torch.float32) for x in full_k]
        full_v = [dequantize(*quantize(x), torch.float32) for x in full_v]
        k, v = torch.cat([full_k[i][c:] for i, c in enumerate(context_lens)]), torch.cat([full_v[i][c:] for i, c in enumerate(context_lens)])

    expected = torch.cat(
        [dense_causal_attention(full_q[i], full_k[i], full_v[i], query_lens[i]) for i in range(len(seq_lens))]
    )
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # write_kv stored this step's K/V where slot_mapping says.
    views = layout.split(kv_cache)
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    for cache, scales, expected_kv in ((views.key, views.key_scale, k), (views.value, views.value_scale, v)):
        stored = cache[blocks, offsets].float() * (1.0 if scales is None else scales[blocks, offsets][..., None])
        torch.testing.assert_close(stored, expected_kv)


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch(backend: str, block_size: int, seed: int) -> None:
    # prefill from scratch, chunk with cached prefix, decodes, a chunk ending mid-block
    context_lens = [0, 23, 40, 7, 0, 16]
    query_lens = [19, 9, 1, 1, 1, 12]
    run_case(backend, context_lens, query_lens, block_size, seed)


@pytest.mark.parametrize("block_size", [16, 5])
def test_only_decodes(backend: str, block_size: int) -> None:
    run_case(backend, [3, 15, 16, 31, 64], [1, 1, 1, 1, 1], block_size, seed=2)


@pytest.mark.parametrize("block_size", [16, 5, 1])
def test_single_prefill(backend: str, block_size: int) -> None:
    run_case(backend, [0], [37], block_size, seed=3)


@pytest.mark.parametrize("block_size", [16, 5])
def test_fp8_cache_mixed_batch(backend: str, block_size: int) -> None:
    """With kv_cache_dtype="fp8" both CPU backends attend over exactly what the cache holds."""
    run_case(backend, [0, 23, 40, 7, 0, 16], [19, 9, 1, 1, 1, 12], block_size, seed=7, fp8=True)


def test_fp8_quantization_error_is_bounded() -> None:
    """e4m3 keeps 3 mantissa bits: with a scale per vector, each element's error is at most half a
    step of its binade (2^-4 relative). The scale is amax / 448 rounded up to a bfloat16 (what the
    cache stores, 2^-7 apart at most), so the largest element lands on 448 and back within 2^-7 of itself.
    Zeros stay zero."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(64, 4, 128, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]
    data, scale = quantize(x)
    amax_scale = x.abs().amax(dim=-1) / FP8_MAX
    assert torch.equal(scale.to(torch.bfloat16).float(), scale)  # exactly a bfloat16
    assert torch.all(scale >= amax_scale) and torch.all(scale <= amax_scale * (1 + 2**-7))
    back = dequantize(data, scale, torch.float32)
    assert torch.all((back - x).abs() <= x.abs() * 2**-4 + scale[..., None] * 2**-9)
    top = x.abs().argmax(dim=-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, top), x.gather(-1, top), rtol=2**-7, atol=0)
    zero_data, zero_scale = quantize(torch.zeros(2, 3, 8))
    assert torch.all(dequantize(zero_data, zero_scale, torch.float32) == 0)


def test_fp8_quantize_keeps_the_cache_finite() -> None:
    """NaN is stored as 0 and infinities clamped, so that a kernel reading a block's unused slots
    (weighted by 0) never meets a NaN; float32's largest values dequantize finite too."""
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[1.0, float("nan"), -2.0, 0.5], [float("inf"), 1.0, float("-inf"), 0.0], [big, -big, 0.0, 1.0]])
    data, scale = quantize(x)
    back = dequantize(data, scale, torch.float32)
    assert torch.isfinite(back).all() and torch.isfinite(scale).all()
    torch.testing.assert_close(back[0], torch.tensor([1.0, 0.0, -2.0, 0.5]), rtol=2**-7, atol=0)
    assert back[1, 0] > 1e38 and back[1, 2] < -1e38


def test_fp8_block_layout() -> None:
    """The bytes of an FP8 block are where kv_cache.py says: keys and values [head, slot, dim],
    scales [head, slot] after each block's data; the views index [block, slot, head, dim]."""
    block_size, heads, dim, num_blocks = 4, 2, 8, 3
    layout = KVCacheLayout(block_size, heads, dim, torch.float32, fp8=True)
    cache = layout.allocate(num_blocks, torch.device("cpu"))
    assert cache.shape == (2, num_blocks, block_size * heads * (dim + 2))
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(num_blocks * block_size, heads, dim, generator=gen) for _ in range(2))
    write_kv(k, v, cache, torch.arange(num_blocks * block_size), layout)
    data_bytes = block_size * heads * dim
    for which, x in ((0, k), (1, v)):
        data, scale = quantize(x.view(num_blocks, block_size, heads, dim))
        row = cache[which, :, :data_bytes]
        assert torch.equal(row, data.view(torch.uint8).permute(0, 2, 1, 3).reshape(num_blocks, -1))
        scales = cache[which, :, data_bytes:].contiguous().view(torch.bfloat16)
        assert torch.equal(scales.float(), scale.transpose(1, 2).reshape(num_blocks, -1))
    views = layout.split(cache)
    torch.testing.assert_close(dequantize(views.value[1, 2], views.value_scale[1, 2], torch.float32),
                               dequantize(*quantize(v[block_size + 2]), torch.float32))


def test_sdpa_backend_plans_each_step_afresh() -> None:
    """The SDPA backend works a step's gather plan out once and reuses it for the step's other
    layers; the next step (new metadata) must get a plan of its own."""
    shared = SdpaAttentionBackend()
    BACKENDS["shared"] = lambda: shared
    try:
        run_case("shared", [0, 23, 40], [19, 9, 1], block_size=16, seed=4)
        run_case("shared", [3, 15, 31], [1, 1, 1], block_size=16, seed=5)
        run_case("shared", [0], [37], block_size=5, seed=6)
    finally:
        del BACKENDS["shared"]


def test_sdpa_groups_decodes_by_length() -> None:
    """Decodes are attended in groups of similar length (each at least half its group's longest,
    up to MAX_DECODE_GROUPS), every group padded to its own longest; the output still equals plain
    attention, prefill chunks in the same step included."""
    from minivllm.worker.attention import cpu_sdpa

    context_lens = [200, 3, 90, 0, 45, 11, 120, 1, 30, 7]
    query_lens = [1, 1, 1, 25, 1, 1, 1, 1, 1, 1]
    run_case("cpu-sdpa", context_lens, query_lens, block_size=16, seed=7)

    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros(len(seq_lens), 16, dtype=torch.int32),
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long), max_query_len=25, max_seq_len=201)
    plan = cpu_sdpa.plan_step(metadata, 16)
    groups = [[seq_lens[int(torch.searchsorted(metadata.query_start_loc, row))] for row in group.rows]
              for group in plan.decodes]
    assert groups == [[201, 121], [91, 46], [31], [12, 8, 4, 2]]  # the fourth (last) group takes the rest
    assert [group.slots.shape[1] for group in plan.decodes] == [201, 91, 31, 12]
    assert len(plan.prefills) == 1
