"""Paged attention on CUDA in Triton: one kernel for a whole mixed batch of prefill chunks and
decodes, reading K/V straight from the block pool.

The work is cut into programs of (query tile, KV head). A query tile is up to BLOCK_Q
consecutive tokens of ONE sequence, times the query heads that share the KV head (GQA), so
each K/V tile loaded from the cache serves BLOCK_M = BLOCK_Q * heads_per_kv query rows at
once through the tensor cores. A program walks its sequence's block table BLOCK_N keys at a
time (several paged blocks per tile), with the online softmax of FlashAttention, and stops at
the last key its tile may see (causal). Decode-only steps use a small BLOCK_M (a decode has
one token); steps with prefill chunks use a large one.

The grid cannot know how many tiles each sequence needs without a device->host sync, so it
uses the bound of vLLM's unified kernel: sequence s owns tiles
[query_start_loc[s] // BLOCK_Q + s, query_start_loc[s+1] // BLOCK_Q + s + 1), which is at
least ceil(query_len / BLOCK_Q) of them; a program finds its sequence by binary search and
exits if its tile is past the sequence's tokens. The grid depends only on the number of
tokens and sequences, so the kernel can be captured in a CUDA graph.

Padding rows (in CUDA-graph buckets) have seq_len 0 and slot -1: nothing is written for
them and their output is zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.worker.attention.metadata import AttentionMetadata


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_token, stride_value_token,
    ROW: tl.constexpr, ROW_PADDED: tl.constexpr,
):
    """One program per token: copy its num_kv_heads * head_dim keys and values to its slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding row
        return
    offs = tl.arange(0, ROW_PADDED)
    mask = offs < ROW
    k = tl.load(key_ptr + token * stride_key_token + offs, mask=mask)
    v = tl.load(value_ptr + token * stride_value_token + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The last sequence s whose first tile (query_start_loc[s] // BLOCK_Q + s) is <= tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2e, num_seqs,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_block_table,
    HEADS_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_in_seq = tile - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step's chunk

    # Row m of the tile is query token (tile_in_seq * BLOCK_Q + m // HEADS_PER_KV) of the chunk,
    # head (kv_head * HEADS_PER_KV + m % HEADS_PER_KV).
    offs_m = tl.arange(0, BLOCK_M)
    token_in_chunk = tile_in_seq * BLOCK_Q + offs_m // HEADS_PER_KV
    head = kv_head * HEADS_PER_KV + offs_m % HEADS_PER_KV
    row_valid = (offs_m < BLOCK_Q * HEADS_PER_KV) & (token_in_chunk < q_len)
    query_pos = context_len + token_in_chunk  # position in the sequence: sees keys 0..query_pos
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    d_valid = offs_d < HEAD_DIM

    q_rows = (q_start + token_in_chunk).to(tl.int64) * stride_q_token + head * stride_q_head
    q = tl.load(query_ptr + q_rows[:, None] + offs_d[None, :], mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)

    # The tile's last query sees keys up to its own position: stop there.
    num_keys = tl.minimum(seq_len, context_len + (tile_in_seq + 1) * BLOCK_Q)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for key_start in range(0, num_keys, BLOCK_N):
        offs_n = key_start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < num_keys
        block_ids = tl.load(block_table + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        kv_rows = block_ids * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_slot + kv_head * stride_cache_head
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + kv_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE_FP32:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale_log2e
        visible = (offs_n[None, :] <= query_pos[:, None]) & n_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE_FP32:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = (q_start + token_in_chunk).to(tl.int64) * stride_o_token + head * stride_o_head
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & d_valid[None, :])


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] to their slots (slot -1: skip)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_cache[0], kv_cache[1], slot_mapping,
        key.stride(0), value.stride(0),
        ROW=row, ROW_PADDED=triton.next_power_of_2(row),
    )


# Tile shapes (BLOCK_M, BLOCK_N, num_warps, num_stages): decode-only steps, steps with prefill chunks.
DECODE_TILES = (16, 64, 4, 2)
PREFILL_TILES = (64, 64, 4, 2)


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
    out: torch.Tensor | None = None, tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> out [num_tokens, num_heads, head_dim]."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    heads_per_kv = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if tiles is None:
        tiles = DECODE_TILES if metadata.max_query_len == 1 else PREFILL_TILES
    block_m, block_n, num_warps, num_stages = tiles
    block_m = max(block_m, triton.next_power_of_2(heads_per_kv))
    block_q = max(1, block_m // heads_per_kv)
    num_seqs = metadata.num_seqs
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache,
        metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
        scale * 1.4426950408889634, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), metadata.block_tables.stride(0),
        HEADS_PER_KV=heads_per_kv, HEAD_DIM=head_dim, HEAD_DIM_PADDED=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE_FP32=query.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


class TritonAttentionBackend:
    """The CUDA backend: store K/V with one kernel, attend with another."""

    name = "triton"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(key, value, kv_cache, metadata.slot_mapping)
        return paged_attention(query, kv_cache, metadata, scale)
