"""The Triton kernels equal the reference paged attention on random mixed batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minivllm.worker.attention.kv_cache import FP8_MAX, KVCacheLayout, dequantize, quantize
from minivllm.worker.attention.metadata import AttentionMetadata, kv_cache_shape
from minivllm.worker.attention.reference import paged_attention as reference_attention
from minivllm.worker.attention.reference import write_kv

pytest.importorskip("triton", reason="needs Triton (the CUDA build of torch)")
from minivllm.worker.attention import fp8_decode  # noqa: E402
from minivllm.worker.attention.triton_attention import (  # noqa: E402
    DECODE,
    DECODE_FP8,
    PREFILL,
    PREFILL_FP8,
    PREFILL_SHORT,
    PREFILL_TINY,
    _SPLIT_SCRATCH,
    DecodeConfig,
    decode_attention,
    paged_attention,
    prefill_config,
    store_kv,
)

# (context already cached, tokens this step): chunks with and without a prefix, decodes, and
# lengths on and off block boundaries.
MIXED = [(0, 37), (16, 16), (0, 1), (100, 1), (31, 1), (64, 70), (5, 200), (1000, 1), (15, 2)]
DECODES = [(n, 1) for n in (1, 15, 16, 17, 63, 64, 65, 300, 1025)]
# A step over PREFILL_FP8's token count: an FP8 cache's fresh prompts and its chunks after a cached
# context then go to two launches (paged_attention).
LARGE_MIXED = MIXED + [(0, 700), (300, 400), (0, 129)]


BLOCK_ORDERS = ("scattered", "ascending", "descending", "shuffled")


def make_batch(cases, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, block_order="scattered"):
    """block_order: how each sequence's cache blocks lie. "scattered": at random (as after a while
    of serving); "ascending": consecutive ids (as a fresh engine hands them out); "descending": a
    run of ids last first (as a recycled pool hands out a finished request's blocks); "shuffled":
    ascending, then shuffled within each 128-key tile's blocks (the Hopper kernel's tiles)."""
    if block_order not in BLOCK_ORDERS:
        raise ValueError(f"block_order must be one of {BLOCK_ORDERS}, got {block_order!r}")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [c + q for c, q in cases]
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 5
    perm = torch.randperm(num_blocks, device="cuda", generator=gen)
    if block_order != "scattered":
        perm = torch.arange(num_blocks, device="cuda")
    tables = torch.zeros(len(cases), max(blocks) + 2, dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        run = perm[start : start + n]
        if block_order == "descending":
            run = run.flip(0)
        elif block_order == "shuffled":
            per_tile = max(1, 128 // block_size)
            run = torch.cat([group[torch.randperm(group.numel(), device="cuda", generator=gen)]
                             for group in run.split(per_tile)])
        tables[i, :n] = run
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
    """(Given k and v as the model gives them, a 16-bit cache's prefill still reads the cache.)"""
    num_kv_heads = 2
    q, k, v, cache, metadata = make_batch(cases, num_kv_heads * heads_per_kv, num_kv_heads, head_dim, block_size,
                                          dtype, seed=head_dim + heads_per_kv)
    expected_cache = cache.clone()
    write_kv(k, v, expected_cache, metadata.slot_mapping)
    store_kv(k, v, cache, metadata.slot_mapping)
    assert torch.equal(cache, expected_cache)

    expected = reference_attention(q.double(), expected_cache.double(), metadata, head_dim**-0.5)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    paged_attention(q, cache, metadata, head_dim**-0.5, out=out, key=k, value=v)
    assert not out.isnan().any()
    error = (out.double() - expected).norm() / expected.norm()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {error:.2e}"


# head_dim 96: rows past the head's 96 padded to 128; block size 7: tiles that blocks do not tile
# (values read key by key, not block by block)
def fp8_step(cases, num_kv_heads: int, heads_per_kv: int, head_dim: int, block_size: int, seed: int,
             split_decodes: bool = True):
    """make_batch's step over an FP8 cache: every cached prefix written (keys 5x the values' scale),
    then the step's own keys and values. -> q, k, v, cache, metadata."""
    dtype = torch.bfloat16
    q, k, v, _, plain = make_batch(cases, num_kv_heads * heads_per_kv, num_kv_heads, head_dim, block_size, dtype,
                                   seed=seed)
    layout = KVCacheLayout(block_size, num_kv_heads, head_dim, dtype, fp8=True)
    metadata = dataclasses.replace(plain, kv_layout=layout, split_decodes=split_decodes)
    num_blocks = int(metadata.block_tables.max()) + 3
    # Garbage wherever nobody writes: the kernels may read a block's unused slots (weighted by 0),
    # so it must not show. Finite garbage: an FP8 cache never holds NaN (kv_cache.py), and 0x7E is
    # e4m3's +448 (and a scale of ~8e37).
    cache = layout.allocate(num_blocks, torch.device("cuda")).fill_(0x7E)
    gen = torch.Generator(device="cuda").manual_seed(1)
    # Every slot of every sequence, the cached prefixes and this step's tokens.
    all_slots = torch.cat([metadata.block_tables[i, : -(-int(n) // block_size)].long()[:, None] * block_size
                           + torch.arange(block_size, device="cuda") for i, n in enumerate(metadata.seq_lens.tolist())]
                          ).flatten()
    prefix = all_slots[~torch.isin(all_slots, metadata.slot_mapping)]
    store_kv(torch.randn(prefix.numel(), num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype) * 5,
             torch.randn(prefix.numel(), num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype),
             cache, prefix, layout)
    store_kv(k, v, cache, metadata.slot_mapping, layout)
    return q, k, v, cache, metadata


def reference_with_own_chunks(q, k, v, cache, metadata) -> torch.Tensor:
    """The reference as the model calls the kernels over an FP8 cache: a chunk of several tokens
    attends its own keys unquantized (k, v), the context before it as the cache holds it; a decode
    (split_decodes) reads its key from the cache."""
    layout = metadata.kv_layout
    views = layout.split(cache)
    plain = torch.zeros(kv_cache_shape(views.key.shape[0], layout.block_size, layout.num_kv_heads, layout.head_dim),
                        device="cuda")
    plain[0] = dequantize(views.key, views.key_scale, torch.float32)
    plain[1] = dequantize(views.value, views.value_scale, torch.float32)
    from_cache = reference_attention(q.float(), plain, dataclasses.replace(metadata, kv_layout=None),
                                     layout.head_dim**-0.5)
    write_kv(k.float(), v.float(), plain, metadata.slot_mapping)
    expected = reference_attention(q.float(), plain, dataclasses.replace(metadata, kv_layout=None),
                                   layout.head_dim**-0.5)
    query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).long()
    decode_rows = torch.repeat_interleave((query_lens == 1) & metadata.split_decodes, query_lens)[:, None, None]
    return torch.where(decode_rows, from_cache, expected)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("heads_per_kv", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32, 7])
@pytest.mark.parametrize("cases", [MIXED, DECODES, LARGE_MIXED], ids=["mixed", "decode", "large"])
def test_fp8_cache(head_dim, heads_per_kv, block_size, cases, split_decodes=True, num_splits=None) -> None:
    """kv_cache_dtype="fp8": store_kv quantizes as the reference does (to within one e4m3 step
    where float division rounds differently), and the kernel attends over exactly what the cache
    holds (the reference reading the same FP8 cache)."""
    q, k, v, cache, metadata = fp8_step(cases, 2, heads_per_kv, head_dim, block_size,
                                        seed=head_dim * heads_per_kv + block_size, split_decodes=split_decodes)
    layout = metadata.kv_layout
    views = layout.split(cache)
    blocks, offsets = metadata.slot_mapping // block_size, metadata.slot_mapping % block_size
    for data, scales, x in ((views.key, views.key_scale, k), (views.value, views.value_scale, v)):
        expected_data, expected_scale = quantize(x)
        assert torch.equal(scales[blocks, offsets].float(), expected_scale)  # the same bfloat16
        stored = dequantize(data[blocks, offsets], scales[blocks, offsets], torch.float32)
        assert torch.all((stored - x.float()).abs() <= x.float().abs() * 2**-4 + expected_scale[..., None] * 2**-8)
        assert stored.abs().amax(-1).allclose(x.float().abs().amax(-1), rtol=1e-2)  # the max maps to +-FP8_MAX
        assert FP8_MAX == 448.0

    expected = reference_attention(q.float(), cache, metadata, head_dim**-0.5)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, cache, metadata, head_dim**-0.5, out=out, num_splits=num_splits)
    assert not out.isnan().any()
    error = (out.float() - expected).norm() / expected.norm()
    assert error < 1e-2, f"relative error {error:.2e}"

    # As the model calls it (reference_with_own_chunks). A large step's chunks without a cached
    # context go to the plain kernel, those after one to _cached_prefill_kernel.
    if cases is LARGE_MIXED:
        assert prefill_config(q.shape[0], torch.bfloat16, head_dim, True) is PREFILL_FP8
    expected_fresh = reference_with_own_chunks(q, k, v, cache, metadata)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, cache, metadata, head_dim**-0.5, out=out, key=k, value=v, num_splits=num_splits)
    assert not out.isnan().any()
    error = (out.float() - expected_fresh).norm() / expected_fresh.norm()
    assert error < 1e-2, f"relative error against the chunk unquantized {error:.2e}"
    query_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
    if (query_lens > 1).any():  # and it is not what reading the chunk's FP8 keys gives
        assert (out.float() - expected).norm() / expected.norm() > 2 * error


# A large FP8 step with long chunks after cached contexts (hundreds of their tiles), decodes, fresh
# prompts, and a chunk whose context is one token.
CACHED_CHUNKS = [(0, 300), (900, 1), (2000, 700), (1, 33), (40, 1), (129, 1200), (0, 90), (17, 2)]


@pytest.mark.parametrize("num_sms", [1, None], ids=["two-programs", "as-many-as-the-gpu-has"])
@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph-padding"])
@pytest.mark.parametrize("heads_per_kv", [1, 2, 8])
def test_fp8_cached_chunks_kernel(monkeypatch, num_sms, padded, heads_per_kv) -> None:
    """_cached_prefill_kernel runs a few programs over the cached chunks' (tile, head) pairs, each
    taking every n-th: with two programs (one SM's worth) each takes 18-123 in turn, and every
    row still equals the reference; fresh prompts' rows (the plain kernel's) and decodes' too.
    With a CUDA graph's padding (an empty-length sequence holding padding tokens, empty ones
    after it, num_active_seqs counting the real ones and the padding one) the padding rows come
    out 0."""
    from minivllm.worker.attention import triton_attention

    if num_sms is not None:
        monkeypatch.setattr(triton_attention, "_num_sms", lambda device: num_sms)
    q, k, v, cache, metadata = fp8_step(CACHED_CHUNKS, 2, heads_per_kv, 128, 16, seed=heads_per_kv)
    expected = reference_with_own_chunks(q, k, v, cache, metadata)
    num_tokens = q.shape[0]
    pad_tokens = 5 if padded else 0
    if padded:
        metadata = dataclasses.replace(
            with_graph_padding(metadata, num_tokens, pad_tokens), kv_layout=metadata.kv_layout,
            num_active_seqs=torch.tensor([len(CACHED_CHUNKS) + 1], dtype=torch.int32, device="cuda"))
    assert prefill_config(num_tokens + pad_tokens, torch.bfloat16, 128, True) is PREFILL_FP8
    query = torch.cat([q, torch.randn_like(q[:pad_tokens])])
    out = torch.full_like(query, float("nan"))
    paged_attention(query, cache, metadata, 128**-0.5, out=out,
                    key=torch.cat([k, torch.randn_like(k[:pad_tokens])]),
                    value=torch.cat([v, torch.randn_like(v[:pad_tokens])]))
    assert torch.equal(out[num_tokens:], torch.zeros_like(out[num_tokens:]))
    starts = metadata.query_start_loc.tolist()
    for i, (context, chunk) in enumerate(CACHED_CHUNKS):
        rows = slice(starts[i], starts[i + 1])
        error = (out[rows].float() - expected[rows]).norm() / expected[rows].norm()
        assert error < 1e-2, f"sequence {i} ({chunk} tokens after {context}): relative error {error:.2e}"


# One long chunk after a long cached context (its launch runs for ~1 ms) among short fresh prompts
# and decodes (theirs take microseconds).
SLOW_CACHED_CHUNK = [(0, 120), (300, 1), (8192, 1024), (0, 200), (50, 1), (0, 64)]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_fp8_step_launches_finish_before_the_next_kernel(graph) -> None:
    """A large FP8 step's fresh prompts' launch runs beside its cached chunks' launch (PDL,
    JOINS_PREVIOUS) and may finish long before it; the kernel after the step's attention must still
    see every row. Here a copy of the output runs right after, in a CUDA graph or eagerly, over
    rows set to NaN before each replay: rows the cached chunk's launch had not yet written would
    come out NaN. (On an H100 this also passed with the fresh launch's last-program wait removed:
    there the stream and the graph kept finishing kernels in launch order. The wait is what PTX
    promises, griddepcontrol.wait returning once the kernel before has completed; the test holds
    the whole step to it, in whatever way a GPU orders them.)"""
    from minivllm.worker import pdl

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("no PDL on this GPU: the launches run one after the other")
    q, k, v, cache, metadata = fp8_step(SLOW_CACHED_CHUNK, 2, 2, 128, 16, seed=3)
    assert prefill_config(q.shape[0], torch.bfloat16, 128, True) is PREFILL_FP8
    expected = reference_with_own_chunks(q, k, v, cache, metadata)
    out, seen = torch.empty_like(q), torch.empty_like(q)

    def step() -> None:
        paged_attention(q, cache, metadata, 128**-0.5, out=out, key=k, value=v)
        seen.copy_(out)

    step()  # (builds the kernels outside the capture)
    replay = step
    if graph:
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            step()
        replay = cuda_graph.replay
    for _ in range(5):
        out.fill_(float("nan"))
        seen.fill_(float("nan"))
        replay()
        torch.cuda.synchronize()
        unwritten = seen.isnan().any(-1).any(-1).nonzero().flatten().tolist()
        assert not unwritten, f"rows not yet written when the next kernel ran: {unwritten[:8]}..."
        error = (seen.float() - expected).norm() / expected.norm()
        assert error < 1e-2, f"relative error {error:.2e}"


@pytest.mark.parametrize("block_size", [32, 7])
@pytest.mark.parametrize("cases", [MIXED, DECODES], ids=["mixed", "decode"])
def test_other_block_sizes(cases, block_size) -> None:
    test_kernel_equals_reference(torch.bfloat16, 128, 2, cases, block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp8"])
@pytest.mark.parametrize("heads_per_kv", [1, 2, 8])
def test_prefill_kernel_takes_decodes_too(dtype, heads_per_kv) -> None:
    """split_decodes=False (a step of a few sequences): no decode kernel; the prefill kernel
    attends the decodes too, as one-token chunks."""
    if dtype == "fp8":
        test_fp8_cache(128, heads_per_kv, 16, MIXED, split_decodes=False)
        return
    q, k, v, cache, metadata = make_batch(MIXED, 2 * heads_per_kv, 2, 128, 16, dtype, seed=heads_per_kv)
    metadata = dataclasses.replace(metadata, split_decodes=False)
    store_kv(k, v, cache, metadata.slot_mapping)
    expected = reference_attention(q.double(), cache.double(), metadata, 128**-0.5)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    paged_attention(q, cache, metadata, 128**-0.5, out=out, key=k, value=v)
    assert not out.isnan().any()
    error = (out.double() - expected).norm() / expected.norm()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {error:.2e}"


# Short chunks after long prefixes (contexts on and off tile and split boundaries), a prompt, decodes.
LONG_CONTEXTS = [(3000, 37), (0, 5), (700, 1), (5000, 200), (64, 2), (4096, 1), (256, 64), (1000, 9)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp8"])
@pytest.mark.parametrize("num_splits", [2, 8])
def test_context_splits(dtype, num_splits) -> None:
    """num_splits > 1 (metadata.step_splits_contexts: a short chunk after a long prefix): programs share
    each context and the last of a tile's splits merges their states; the answer is the reference's, every
    row written."""
    if dtype == "fp8":
        test_fp8_cache(128, 2, 16, LONG_CONTEXTS, split_decodes=False, num_splits=num_splits)
        return
    q, k, v, cache, metadata = make_batch(LONG_CONTEXTS, 4, 2, 128, 16, dtype, seed=num_splits)
    metadata = dataclasses.replace(metadata, split_decodes=False)
    store_kv(k, v, cache, metadata.slot_mapping)
    expected = reference_attention(q.double(), cache.double(), metadata, 128**-0.5)
    for _ in range(2):  # each tile's arrival count is back at 0 for the next launch
        out = torch.full_like(q, float("nan"))
        paged_attention(q, cache, metadata, 128**-0.5, out=out, key=k, value=v, num_splits=num_splits)
        assert not out.isnan().any()
        error = (out.double() - expected).norm() / expected.norm()
        assert error < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {error:.2e}"
    assert all(not scratch.arrivals.any() for scratch in _SPLIT_SCRATCH.values())
    if dtype != torch.float32:  # fewer, taller tiles: each reads the whole context
        assert prefill_config(64, dtype, 128, False, splits=True) == PREFILL_SHORT


@pytest.mark.parametrize("num_tokens", [2, 64, 128, 129, 1024, 2048, 2049, 8192])
def test_tile_shape_by_step_size(num_tokens) -> None:
    """Short steps take smaller tiles (prefill_config), and every shape gives the reference's
    answer: a few sequences whose tokens add up to num_tokens, one with a cached prefix."""
    half, quarter = num_tokens // 2, num_tokens // 4
    lens = [num_tokens] if num_tokens < 4 else [half, quarter, num_tokens - half - quarter]
    cases = [(100 if i == 1 else 0, n) for i, n in enumerate(lens)]
    q, k, v, cache, metadata = make_batch(cases, 4, 2, 128, 16, torch.bfloat16, seed=num_tokens)
    store_kv(k, v, cache, metadata.slot_mapping)
    expected = reference_attention(q.double(), cache.double(), metadata, 128**-0.5)
    out = paged_attention(q, cache, metadata, 128**-0.5, key=k, value=v)
    error = (out.double() - expected).norm() / expected.norm()
    assert error < 1e-2, f"relative error {error:.2e}"
    config = prefill_config(num_tokens, torch.bfloat16, 128, fp8=False)
    assert config == (PREFILL_TINY if num_tokens <= 128 else PREFILL_SHORT if num_tokens <= 2048 else PREFILL)


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


def with_graph_padding(metadata: AttentionMetadata, num_tokens: int, pad_tokens: int) -> AttentionMetadata:
    """A mixed CUDA-graph bucket's padding after a step's num_tokens: one sequence of length 0
    holding the pad_tokens padding tokens (slot -1), then two empty sequences."""
    ends = torch.tensor([num_tokens + pad_tokens] * 3, dtype=torch.int32, device="cuda")
    return AttentionMetadata(
        query_start_loc=torch.cat([metadata.query_start_loc, ends]),
        seq_lens=torch.cat([metadata.seq_lens, torch.zeros(3, dtype=torch.int32, device="cuda")]),
        block_tables=torch.cat([metadata.block_tables, torch.zeros_like(metadata.block_tables[:3])]),
        slot_mapping=torch.cat([metadata.slot_mapping, torch.full((pad_tokens,), -1, device="cuda")]),
        max_query_len=metadata.max_query_len, max_seq_len=metadata.max_seq_len,
    )


@pytest.mark.parametrize("pad_tokens", [1, 3])
def test_mixed_step_padding(pad_tokens) -> None:
    """A mixed CUDA-graph bucket's padding: its padding tokens form one sequence of length 0 (one
    token goes to the decode kernel, several to the prefill kernel), then empty sequences. They
    read nothing, come out zero, and the real rows still equal the reference."""
    q, k, v, cache, metadata = make_batch(MIXED, 4, 2, 128, 16, torch.bfloat16, seed=pad_tokens)
    store_kv(k, v, cache, metadata.slot_mapping)
    expected = reference_attention(q.double(), cache.double(), metadata, 128**-0.5)
    num_tokens = q.shape[0]
    padded = with_graph_padding(metadata, num_tokens, pad_tokens)
    out = torch.full((num_tokens + pad_tokens, *q.shape[1:]), float("nan"), dtype=q.dtype, device="cuda")
    paged_attention(torch.cat([q, torch.randn_like(q[:pad_tokens])]), cache, padded, 128**-0.5, out=out)
    assert torch.equal(out[num_tokens:], torch.zeros_like(out[num_tokens:]))
    error = (out[:num_tokens].double() - expected).norm() / expected.norm()
    assert error < 1e-2, f"relative error {error:.2e}"


LONG_DECODES = [(n, 1) for n in (1, 15, 16, 17, 300, 1025, 5000)]


def decode_metadata_with_padding(plain: AttentionMetadata, layout: KVCacheLayout) -> AttentionMetadata:
    """A decode-only batch's metadata in `layout`, with two padding rows at the end (seq_len 0,
    slot -1), as a CUDA-graph bucket has."""
    num_seqs = plain.seq_lens.shape[0]
    return AttentionMetadata(
        query_start_loc=torch.arange(num_seqs + 3, dtype=torch.int32, device="cuda"),
        seq_lens=torch.cat([plain.seq_lens, torch.zeros(2, dtype=torch.int32, device="cuda")]),
        block_tables=torch.cat([plain.block_tables, torch.zeros_like(plain.block_tables[:2])]),
        slot_mapping=torch.cat([plain.slot_mapping, torch.full((2,), -1, device="cuda")]),
        max_query_len=1, max_seq_len=plain.max_seq_len, kv_layout=layout,
    )


def cache_in_layout(plain_cache, k, v, slot_mapping, layout: KVCacheLayout) -> torch.Tensor:
    """make_batch's plain cache written into a cache of `layout` (every slot), then this step's k/v."""
    _, num_blocks, block_size, num_kv_heads, head_dim = plain_cache.shape
    cache = layout.allocate(num_blocks, torch.device("cuda"))
    flat = plain_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    store_kv(flat[0], flat[1], cache, torch.arange(num_blocks * block_size, device="cuda"), layout)
    store_kv(k, v, cache, slot_mapping, layout)
    return cache


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("block_n", [32, 128])
@pytest.mark.parametrize("num_splits", [1, 4, 16])
@pytest.mark.parametrize("heads_per_kv", [1, 2, 4])
def test_decode_kernel(fp8, block_n, num_splits, heads_per_kv, block_size=16) -> None:
    """The decode kernel (split-KV or not) equals the reference; padding rows (seq_len 0) come out zero."""
    num_kv_heads, head_dim, dtype = 2, 128, torch.bfloat16
    cases = LONG_DECODES
    q, k, v, plain_cache, plain = make_batch(cases, num_kv_heads * heads_per_kv, num_kv_heads, head_dim,
                                             block_size, dtype, seed=heads_per_kv * 10 + num_splits)
    layout = KVCacheLayout(block_size, num_kv_heads, head_dim, dtype, fp8=fp8)
    cache = cache_in_layout(plain_cache, k, v, plain.slot_mapping, layout)
    metadata = decode_metadata_with_padding(plain, layout)
    q = torch.cat([q, torch.randn_like(q[:2])])
    expected = reference_attention(q.float(), cache, metadata, head_dim**-0.5)
    out = torch.full_like(q, float("nan"))
    config = DecodeConfig(block_n=block_n)
    decode_attention(q, cache, metadata, head_dim**-0.5, out=out, config=config, num_splits=num_splits)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))
    error = (out[:-2].float() - expected[:-2]).norm() / expected[:-2].norm()
    assert error < 1e-2, f"relative error {error:.2e}"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("longest_first", [False, True])
def test_decode_many_sequences(fp8, longest_first) -> None:
    """A decode batch of more programs than the GPU has SMs, lengths all over: the kernel runs the
    longest sequences first (or in order) and every row equals the reference."""
    num_kv_heads, heads_per_kv, head_dim, block_size, dtype = 8, 2, 128, 16, torch.bfloat16
    lengths = torch.randint(1, 1500, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    cases = [(n, 1) for n in lengths]
    q, k, v, plain_cache, plain = make_batch(cases, num_kv_heads * heads_per_kv, num_kv_heads, head_dim, block_size,
                                             dtype, seed=11)
    layout = KVCacheLayout(block_size, num_kv_heads, head_dim, dtype, fp8=fp8)
    cache = cache_in_layout(plain_cache, k, v, plain.slot_mapping, layout)
    metadata = dataclasses.replace(plain, kv_layout=layout)
    expected = reference_attention(q.float(), cache, metadata, head_dim**-0.5)
    out = torch.full_like(q, float("nan"))
    config = (DECODE_FP8 if fp8 else DECODE)._replace(longest_first=longest_first)
    decode_attention(q, cache, metadata, head_dim**-0.5, out=out, config=config, num_splits=1)
    order = metadata.longest_first()
    assert torch.equal(metadata.seq_lens[order.long()], metadata.seq_lens.sort(descending=True).values)
    error = (out.float() - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error.max() < 2e-2, f"relative error {error.max():.2e}"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("with_norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("num_splits", [1, 4, 16])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 128), (64, 32), (128, 64)])
def test_decode_rotating_equals_rope_kernel_then_decode(fp8, with_norm, num_splits, head_dim, rotary_dim,
                                                       cases=LONG_DECODES) -> None:
    """decode_attention(rope=...) takes q/k before the per-head norm and RoPE: its output, and the
    cache it leaves (this step's k rotated, and v, in every sequence's newest slot; nothing for
    padding rows), equal those of ops.norm_rope storing K/V and then the plain decode kernel."""
    from minivllm.worker import ops
    from minivllm.worker.attention.metadata import RopeInputs

    num_kv_heads, heads_per_kv, block_size, dtype = 2, 4, 16, torch.bfloat16
    num_heads = num_kv_heads * heads_per_kv
    _, _, _, plain_cache, plain = make_batch(cases, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=3)
    layout = KVCacheLayout(block_size, num_kv_heads, head_dim, dtype, fp8=fp8)
    cache = layout.allocate(plain_cache.shape[1], torch.device("cuda"))
    flat = plain_cache.view(2, -1, num_kv_heads, head_dim)
    store_kv(flat[0], flat[1], cache, torch.arange(flat.shape[1], device="cuda"), layout)
    metadata = decode_metadata_with_padding(plain, layout)
    num_tokens = len(cases) + 2
    positions = (metadata.seq_lens.long() - 1).clamp(min=0)
    gen = torch.Generator(device="cuda").manual_seed(7)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device="cuda", generator=gen).to(dtype)
    freqs = torch.arange(8192, device="cuda")[:, None] * torch.rand(rotary_dim // 2, device="cuda", generator=gen)[None]
    cos, sin = freqs.cos(), freqs.sin()
    norms = (torch.randn(head_dim, device="cuda", generator=gen).to(dtype),
             torch.randn(head_dim, device="cuda", generator=gen).to(dtype)) if with_norm else (None, None)

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        parts = t.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        return [p.view(num_tokens, -1, head_dim) for p in parts]

    scale = head_dim**-0.5
    expected_cache = cache.clone()
    q, k, v = split(qkv.clone())
    ops.norm_rope(q, k, positions, cos, sin, *norms, eps=1e-6, kv_store=(v, expected_cache, metadata.slot_mapping, layout))
    expected = decode_attention(q, expected_cache, metadata, scale, num_splits=num_splits)

    qkv_before = qkv.clone()
    q, k, v = split(qkv)
    out = decode_attention(q, cache, metadata, scale, num_splits=num_splits,
                           rope=RopeInputs(k, v, positions, cos, sin, *norms, eps=1e-6))
    if not fp8_decode.supports(q, layout, metadata.num_seqs):  # Triton rotates in registers: qkv left alone
        assert torch.equal(qkv, qkv_before)  # (the CUDA FP8 kernel's steps rotate it in place: ops.norm_rope)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))
    # The same operations in the same dtypes, but the compiler may fuse a multiply and an add in one
    # kernel and not the other: an element a bfloat16 rounding apart here and there.
    error = (out.float() - expected.float()).norm() / expected.float().norm()
    assert error < 1e-2, f"relative error {error:.2e}"

    def as_values(c: torch.Tensor) -> torch.Tensor:  # the cache's keys and values, dequantized
        views = layout.split(c)
        if not fp8:
            return torch.stack([views.key, views.value]).float()
        key = dequantize(views.key, views.key_scale, torch.float32)
        return torch.stack([key, dequantize(views.value, views.value_scale, torch.float32)])

    values, expected_values = as_values(cache).flatten(1, 2), as_values(expected_cache).flatten(1, 2)
    slots = metadata.slot_mapping[:-2]
    # nothing touched outside this step's slots (none for the padding rows) ...
    others = torch.ones(values.shape[1], dtype=torch.bool, device="cuda")
    others[slots] = False
    assert torch.equal(values[:, others], expected_values[:, others])
    # ... and there, v exact and k a rounding apart at most
    assert torch.equal(values[1, slots], expected_values[1, slots])
    cache_error = (values[0, slots] - expected_values[0, slots]).norm() / expected_values[0, slots].norm()
    assert cache_error < (3e-2 if fp8 else 1e-2), f"cache relative error {cache_error:.2e}"
