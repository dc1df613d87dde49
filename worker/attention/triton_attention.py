"""Paged attention on CUDA in Triton, reading K/V straight from the block pool: a prefill kernel
for the sequences of a step with several tokens (prefill chunks, speculative verifies) and a
decode kernel for those with one.

Prefill: the work is cut into programs of (query tile, KV head). A query tile is up to BLOCK_Q
consecutive tokens of ONE sequence, times the query heads that share the KV head (GQA), so
each K/V tile loaded from the cache serves BLOCK_M = BLOCK_Q * heads_per_kv query rows at
once through the tensor cores. A program walks its sequence's block table BLOCK_N keys at a
time (several paged blocks per tile), with the online softmax of FlashAttention, and stops at
the last key its tile may see (causal). Key tiles that every row of the query tile sees whole
(all but the last one or two) take a loop without masks; only the diagonal pays for them.
Later tiles of a sequence have more keys to walk, so programs start from the last tile.

The grid cannot know how many tiles each sequence needs without a device->host sync, so it
uses the bound of vLLM's unified kernel: sequence s owns tiles
[query_start_loc[s] // BLOCK_Q + s, query_start_loc[s+1] // BLOCK_Q + s + 1), which is at
least ceil(query_len / BLOCK_Q) of them; a program finds its sequence by binary search and
exits if its tile is past the sequence's tokens. The grid depends only on the number of
tokens and sequences, so the kernel can be captured in a CUDA graph.

Padding rows (in CUDA-graph buckets) have seq_len 0 and slot -1: nothing is written for
them and their output is zero.

A large step over an FP8 cache takes two launches: its fresh prompts on the plain kernel (they
read no cache), its chunks after a cached context on _cached_prefill_kernel, a few programs that
read the step's query lengths whole and loop over those chunks' tiles only (a grid of every
possible tile would be ~30 waves of programs that exit).

Decode: one program per (sequence, KV head, split): the GQA group's query heads form one tile
(in a prefill tile a decode would fill a single row of BLOCK_M), and when a decode-only batch is
too small to fill the GPU each sequence's keys are split across several programs whose partial
softmax states a second kernel merges (flash-decoding), so a few long contexts use every SM. In a
step with prefill chunks both kernels run, each skipping the other's sequences, unless the step has
only a few (metadata.split_decodes False): the prefill kernel then takes its decodes too. A
decode-only step can hand the kernel q, k and v before the per-head norm and RoPE (`rope`): it
rotates them in registers and stores this step's K/V itself, in place of ops.norm_rope's kernel.

Decode steps of many sequences over an FP8 cache, and such a mixed step's decodes, go to a CUDA
kernel where one is built (fp8_decode.py: Triton's kernel reads an FP8 cache at ~2.4 TB/s on an
H100, that one at ~2.6-2.7).

An FP8 cache (kv_cache.py) is read as e4m3 and widened to float16 for the dots; each key's scale
multiplies its column of scores and each value's scale the column of probabilities that weighs it,
so nothing is dequantized in full. A key's values are one row of the cache, as its keys are
(kv_cache.py). Score tiles load whole blocks' scales where a mask along the slots would cost the
loads their width; the slots past a sequence's end then weigh 0, and an FP8 cache holds finite
values only, so they add nothing.

Tile offsets are computed from tl.arange (_tile_slots) wherever blocks tile a tile, so that the
compiler sees runs of BLOCK_SIZE consecutive slots: with the offsets computed from key positions,
it loaded an FP8 value tile byte by byte and a scale per instruction.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from minivllm.worker import pdl
from minivllm.worker.attention import fp8_decode, hopper_prefill
from minivllm.worker.attention.kv_cache import FINITE_MAX, FP8_MAX, MIN_SCALE, KVCacheLayout, KVCacheViews, plain_layout
from minivllm.worker.attention.metadata import (
    DECODE_LONG_CONTEXT,
    FEW_SEQS_SPLIT_MAX_TOKENS,
    AttentionBackend,
    AttentionMetadata,
    RopeInputs,
    step_splits_contexts,
)


@triton.jit
def store_token_kv(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr, token,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_scale_block, stride_scale_slot, stride_scale_head,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PADDED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):
    """Write one token's keys and values (every KV head) to its slot (slot -1: a padding row, none);
    for an FP8 cache, each head's vector as e4m3 plus its scale, amax / FP8_MAX, NaN stored as 0 and
    infinities clamped (kv_cache.py: the kernels may read unwritten slots). The body of
    _store_kv_kernel, and of the RoPE kernel that stores as it rotates (worker/ops.py)."""
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, KV_HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    head_valid = heads < NUM_KV_HEADS
    dim_valid = dims < HEAD_DIM
    mask = head_valid[:, None] & dim_valid[None, :]
    k = tl.load(key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :], mask=mask)
    write_kv_heads(k, v, heads, head_valid, dims, dim_valid, slot, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                   stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                   stride_scale_block, stride_scale_slot, stride_scale_head, BLOCK_SIZE, FP8, FP8_MAX, MIN_SCALE)


@triton.jit
def write_kv_heads(
    k, v, heads, head_valid, dims, dim_valid, slot, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_scale_block, stride_scale_slot, stride_scale_head,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):
    """Write one token's tiles k, v [len(heads), len(dims)] (head_valid, dim_valid: which rows and
    columns are real) to cache slot `slot` (-1: a padding row, nothing); for an FP8 cache each
    head's vector as e4m3 plus its scale."""
    # A padding row writes nothing (a mask rather than an early return: this body is inlined
    # into other kernels).
    slot_valid = slot >= 0
    mask = head_valid[:, None] & dim_valid[None, :]
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k_offs = block * stride_cache_block + offset * stride_k_slot + heads[:, None] * stride_k_head + dims[None, :]
    v_offs = block * stride_cache_block + offset * stride_v_slot + heads[:, None] * stride_v_head + dims[None, :]
    if FP8:
        scale_offs = block * stride_scale_block + offset * stride_scale_slot + heads * stride_scale_head
        k, k_scale = quantize_rows(k, FP8_MAX, MIN_SCALE)
        tl.store(k_scale_ptr + scale_offs, k_scale, mask=head_valid & slot_valid)
        v, v_scale = quantize_rows(v, FP8_MAX, MIN_SCALE)
        tl.store(v_scale_ptr + scale_offs, v_scale, mask=head_valid & slot_valid)
    tl.store(k_cache_ptr + k_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask & slot_valid)
    tl.store(v_cache_ptr + v_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask & slot_valid)


# kv_cache.FINITE_MAX, as a constant the kernels can read.
CLAMP_MAX: tl.constexpr = tl.constexpr(FINITE_MAX)


@triton.jit
def quantize_rows(x, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """x [rows, dims] -> (x / scale in float32, ready to cast to e4m3; scale [rows] = amax / FP8_MAX
    rounded up to a bfloat16 value, as kv_cache.quantize), NaN taken as 0 and anything past
    +-FINITE_MAX (infinities too) clamped to it first."""
    x = x.to(tl.float32)
    x = tl.minimum(tl.maximum(tl.where(x == x, x, 0.0), -CLAMP_MAX), CLAMP_MAX)
    # (IEEE division, as torch's and the CUDA epilogue's: the rounding up below must start from the same value)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), MIN_SCALE)
    scale = ((scale.to(tl.int32, bitcast=True) + 0xFFFF) & -0x10000).to(tl.float32, bitcast=True)
    return x / scale[:, None], scale


@triton.jit
def normed_rotated_heads(
    base_ptr, heads, stride_head, head_valid, dims, dim_valid, norm_ptr, cos_ptr, sin_ptr, position, eps,
    HEAD_DIM: tl.constexpr, HALF_ROT: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """The head vectors at base_ptr + heads * stride_head ([len(heads), len(dims)] tile), each
    RMS-normed over its head_dim (HAS_NORM: Qwen3's q/k norm, weights at norm_ptr) and rotated by
    RoPE at `position` ("rotate half", HALF_ROT = rotary_dim / 2; cos/sin [max_position, HALF_ROT]).
    The body of ops.norm_rope's kernel, and of the decode kernel that rotates in registers: a dim's
    rotation partner (d +- HALF_ROT) is loaded as a second tile rather than sliced out."""
    rotated = dims < 2 * HALF_ROT
    first_half = dims < HALF_ROT
    partner = tl.where(first_half, dims + HALF_ROT, tl.where(rotated, dims - HALF_ROT, dims))
    mask = head_valid[:, None] & dim_valid[None, :]
    rows = base_ptr + heads[:, None] * stride_head
    x = tl.load(rows + dims[None, :], mask=mask, other=0.0)
    x_partner = tl.load(rows + partner[None, :], mask=mask, other=0.0)
    if HAS_NORM:
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)
        weight = tl.load(norm_ptr + dims, mask=dim_valid)
        weight_partner = tl.load(norm_ptr + partner, mask=dim_valid)
        x_partner = (x_partner.to(tl.float32) * rstd[:, None]).to(x.dtype) * weight_partner[None, :]
        x = (xf * rstd[:, None]).to(x.dtype) * weight[None, :]
    angle = tl.where(first_half, dims, dims - HALF_ROT)
    c = tl.load(cos_ptr + position * HALF_ROT + angle, mask=rotated, other=1.0).to(x.dtype)
    s = tl.load(sin_ptr + position * HALF_ROT + angle, mask=rotated, other=0.0).to(x.dtype)
    # first half: x1 cos - x2 sin; second half: x2 cos + x1 sin; past the rotary dims: x
    return tl.where(first_half[None, :], x * c[None, :] - x_partner * s[None, :],
                    tl.where(rotated[None, :], x * c[None, :] + x_partner * s[None, :], x))


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_scale_block, stride_scale_slot, stride_scale_head,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PADDED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):
    """One program per token: store_token_kv."""
    store_token_kv(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
        tl.program_id(0).to(tl.int64), stride_key_token, stride_key_head, stride_value_token, stride_value_head,
        stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
        stride_scale_block, stride_scale_slot, stride_scale_head,
        NUM_KV_HEADS, KV_HEADS_PADDED, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_SIZE, FP8, FP8_MAX, MIN_SCALE)


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
def _tile_slots(key_start, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(block-table index, slot in block) of keys [key_start, key_start + BLOCK_N), key_start a
    multiple of BLOCK_N. When blocks tile the tile, both are written from tl.arange, so that the
    compiler sees runs of BLOCK_SIZE consecutive slots (and vectorizes loads along them)."""
    if BLOCK_N % BLOCK_SIZE == 0:
        local_n = tl.arange(0, BLOCK_N)
        return key_start // BLOCK_SIZE + local_n // BLOCK_SIZE, local_n % BLOCK_SIZE
    offs_n = key_start + tl.arange(0, BLOCK_N)
    return offs_n // BLOCK_SIZE, offs_n % BLOCK_SIZE


@triton.jit
def _fp8_value_runs(
    v_cache_ptr, block_table, key_start, num_keys, kv_head, stride_cache_block, stride_v_head,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):
    """The values [BLOCK_N, HEAD_DIM] (e4m3) of keys [key_start, key_start + BLOCK_N) from an FP8
    cache, BLOCK_N a multiple of BLOCK_SIZE: a head's values in a block are one run of BLOCK_SIZE
    rows of HEAD_DIM bytes (kv_cache.py), loaded as such runs, consecutive threads reading consecutive
    bytes. (Loaded as [key, dim] rows, the compiler gave each thread 8-byte copies, the keys' 16.)
    MASKED: only blocks holding keys below num_keys are read; the rest read as 0."""
    BLOCKS: tl.constexpr = BLOCK_N // BLOCK_SIZE
    block_index = key_start // BLOCK_SIZE + tl.arange(0, BLOCKS)
    offs_run = tl.arange(0, BLOCK_SIZE * HEAD_DIM)  # (slot, dim) of a block's values
    if MASKED:
        valid = block_index * BLOCK_SIZE < num_keys
        block_ids = tl.load(block_table + block_index, mask=valid, other=0).to(tl.int64)
    else:
        block_ids = tl.load(block_table + block_index).to(tl.int64)
    ptrs = v_cache_ptr + (block_ids * stride_cache_block + kv_head * stride_v_head)[:, None] + offs_run[None, :]
    if MASKED:
        v = tl.load(ptrs, mask=valid[:, None], other=0.0)
    else:
        v = tl.load(ptrs)
    return tl.reshape(v, (BLOCK_N, HEAD_DIM))


@triton.jit
def _fp8_values_product(
    p, v_cache_ptr, v_scale_ptr, block_table, key_start, num_keys, block_base, slot, kv_head, scale_cols, offs_d,
    n_valid, block_valid, stride_cache_block, stride_v_slot, stride_v_head, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr, MASKED: tl.constexpr, IEEE_FP32: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """p [rows, BLOCK_N] times the tile's values of an FP8 cache (a key's values are one row, as its
    keys are: kv_cache.py; read block by block where blocks tile the tile and rows are unpadded:
    _fp8_value_runs). Each value's scale goes on its column of p, relative to the tile's largest,
    which multiplies the product (a scale folded into p whole could underflow float16). MASKED: keys
    past the end (not n_valid) weigh 0."""
    if MASKED:
        v_scale = tl.where(n_valid, tl.load(v_scale_ptr + scale_cols, mask=block_valid).to(tl.float32), 0.0)
    else:
        v_scale = tl.load(v_scale_ptr + scale_cols).to(tl.float32)
    v_scale_max = tl.max(v_scale, axis=0)
    p = p * (v_scale / v_scale_max)[None, :]
    if BLOCK_N % BLOCK_SIZE == 0 and HEAD_DIM == HEAD_DIM_PADDED:
        v = _fp8_value_runs(v_cache_ptr, block_table, key_start, num_keys, kv_head, stride_cache_block, stride_v_head,
                            HEAD_DIM, BLOCK_SIZE, BLOCK_N, MASKED)
    else:
        v_ptrs = v_cache_ptr + (block_base + slot * stride_v_slot + kv_head * stride_v_head)[:, None] \
            + offs_d[None, :]
        if MASKED:
            v = tl.load(v_ptrs, mask=n_valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif HEAD_DIM == HEAD_DIM_PADDED:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    if IEEE_FP32:
        return tl.dot(p, v.to(tl.float32), input_precision="ieee") * v_scale_max
    return tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE)) * v_scale_max


@triton.jit
def _softmax_step(scores, m_i, l_i, scale_log2e, visible, MASKED: tl.constexpr):
    """The online softmax's update for one tile of scores: (p, alpha, l_i, m_new). The running max
    m_i is kept in log2 units (scores * scale_log2e), so the exponent is one fused multiply-add
    per score. MASKED: `visible` says which scores count (the rest become -inf)."""
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1) * scale_log2e)
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    else:
        m_safe = m_new
    p = tl.math.exp2(scores * scale_log2e - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return p, alpha, l_i * alpha + tl.sum(p, axis=1), m_new


@triton.jit
def _attend_fresh_tile(
    q, acc, l_i, m_i, key_start, token_in_chunk, chunk_keys, key_rows, value_rows, scale_log2e,
    stride_key_token, stride_value_token, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    """One step of the online softmax over keys [key_start, key_start + BLOCK_N) of the step's own
    chunk, read from the key and value tensors the layer just computed (contiguous rows, the
    model's dtype) instead of the cache: no block table to follow, and an FP8 cache's chunk is
    attended unquantized. MASKED: the causal diagonal and the chunk's end."""
    offs_j = key_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    k_ptrs = key_rows + offs_j.to(tl.int64)[:, None] * stride_key_token + offs_d[None, :]
    v_ptrs = value_rows + offs_j.to(tl.int64)[:, None] * stride_value_token + offs_d[None, :]
    if MASKED:
        kv_mask = (offs_j < chunk_keys)[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif HEAD_DIM == HEAD_DIM_PADDED:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        kv_mask = offs_d[None, :] < HEAD_DIM
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    if IEEE_FP32:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    visible = (offs_j[None, :] <= token_in_chunk[:, None]) & (offs_j < chunk_keys)[None, :]
    p, alpha, l_i, m_new = _softmax_step(scores, m_i, l_i, scale_log2e, visible, MASKED)
    if IEEE_FP32:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _attend_key_tile(
    q, acc, l_i, m_i, key_start, query_pos, num_keys, block_table, kv_head, scale_log2e,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_scale_block, stride_scale_slot, stride_scale_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IEEE_FP32: tl.constexpr, FP8: tl.constexpr,
):
    """One step of the online softmax: the tile's queries against keys [key_start, key_start +
    BLOCK_N) (key_start a multiple of BLOCK_N). MASKED=False is for key tiles every query of the
    tile sees whole (no causal or length mask, no masked loads); MASKED=True for the diagonal and
    the sequence's last keys."""
    key_start = tl.multiple_of(key_start, BLOCK_N)
    offs_n = key_start + tl.arange(0, BLOCK_N)
    block_index, slot = _tile_slots(key_start, BLOCK_SIZE, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    if MASKED:
        n_valid = offs_n < num_keys
        # whole blocks, for loads along the slots (an FP8 cache holds finite values only)
        block_valid = block_index * BLOCK_SIZE < num_keys
        block_ids = tl.load(block_table + block_index, mask=block_valid, other=0).to(tl.int64)
    else:
        block_ids = tl.load(block_table + block_index).to(tl.int64)
    block_base = block_ids * stride_cache_block
    k_ptrs = k_cache_ptr + (block_base + slot * stride_k_slot + kv_head * stride_k_head)[:, None] + offs_d[None, :]
    if MASKED:
        kv_mask = n_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    elif HEAD_DIM == HEAD_DIM_PADDED:
        k = tl.load(k_ptrs)
    else:
        kv_mask = offs_d[None, :] < HEAD_DIM
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    # An FP8 key is e4m3 * scale (one scale per key): the dot runs on the e4m3 values widened to
    # the query's dtype, and each key's column of scores takes its scale.
    if IEEE_FP32:
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k).to(q.dtype))
    if FP8:
        scale_cols = block_ids * stride_scale_block + slot * stride_scale_slot + kv_head * stride_scale_head
        if MASKED:
            scores = scores * tl.load(k_scale_ptr + scale_cols, mask=block_valid).to(tl.float32)[None, :]
        else:
            scores = scores * tl.load(k_scale_ptr + scale_cols).to(tl.float32)[None, :]
    visible = None
    if MASKED:
        visible = (offs_n[None, :] <= query_pos[:, None]) & n_valid[None, :]
    p, alpha, l_i, m_new = _softmax_step(scores, m_i, l_i, scale_log2e, visible, MASKED)
    if FP8:
        pv = _fp8_values_product(
            p, v_cache_ptr, v_scale_ptr, block_table, key_start, num_keys, block_base, slot, kv_head, scale_cols,
            offs_d, n_valid if MASKED else None, block_valid if MASKED else None, stride_cache_block, stride_v_slot,
            stride_v_head, HEAD_DIM, HEAD_DIM_PADDED, MASKED, IEEE_FP32, q.dtype, BLOCK_SIZE, BLOCK_N)
        return acc * alpha[:, None] + pv, l_i, m_new
    v_ptrs = v_cache_ptr + (block_base + slot * stride_v_slot + kv_head * stride_v_head)[:, None] \
        + offs_d[None, :]
    if MASKED or HEAD_DIM != HEAD_DIM_PADDED:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptrs)
    if IEEE_FP32:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _attend_query_tile(
    out_ptr, query_ptr, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_table, q_start, q_len, seq_len, tile_in_seq, kv_head, split, num_used, context_tiles, arrival,
    scale_log2e,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_scale_block, stride_scale_slot, stride_scale_head,
    partial_out_ptr, partial_max_ptr, partial_sum_ptr, arrivals_ptr, num_heads,
    HEADS_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE_FP32: tl.constexpr, FP8: tl.constexpr, FRESH_KV: tl.constexpr, NUM_SPLITS: tl.constexpr,
    CONTEXT: tl.constexpr = True,
):
    """Query tile tile_in_seq of a sequence (its chunk's rows [q_start, q_start + q_len), seq_len
    keys in all, block_table its row) for kv_head's heads, written to out: the prefill kernels'
    work once a program knows its tile. With NUM_SPLITS > 1, split `split` of num_used over
    context_tiles whole key tiles of its context; arrival is its count's place in arrivals_ptr.
    CONTEXT False (with FRESH_KV): the sequence has no cached context, so the cache loops are not
    compiled (their pipelines' shared memory and registers are the tile shape's)."""
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
    q_ptrs = query_ptr + q_rows[:, None] + offs_d[None, :]
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    if FP8 and not IEEE_FP32:  # e4m3 widens to float16 cheaply (see _paged_decode_kernel)
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)

    # The keys read from the cache, [0, cache_end): the context before the chunk when the chunk's
    # own keys come from key_ptr / value_ptr (every row sees all of it), else all up to the tile's
    # last query. Tiles every row sees whole skip the masks (cache_unmasked_end); the rest, the
    # causal diagonal or the context's end, are masked. (A mixed graph's padding tokens form a
    # sequence of length 0: negative positions, no keys.)
    if FRESH_KV:
        cache_end = tl.maximum(context_len, 0)
        cache_unmasked_end = cache_end // BLOCK_N * BLOCK_N
    else:
        first_pos = context_len + tile_in_seq * BLOCK_Q
        cache_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
        cache_unmasked_end = tl.maximum(tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, cache_end), 0)
    key_lo = 0
    key_hi = cache_unmasked_end
    is_last = True
    if NUM_SPLITS > 1:  # split s: context tiles [s * n // used, (s + 1) * n // used); the last, the rest too
        is_last = split == num_used - 1
        key_lo = split * context_tiles // num_used * BLOCK_N
        key_hi = tl.where(is_last, cache_unmasked_end, (split + 1) * context_tiles // num_used * BLOCK_N)
        cache_end = tl.where(is_last, cache_end, key_hi)  # (no masked tiles but the last split's)
    if CONTEXT:
        # Two loops, each compiled apart: the tiles every row sees whole, then the masked ones.
        for masked in tl.static_range(2):
            if masked:
                start, end = key_hi, cache_end
            else:
                start, end = key_lo, key_hi
            for key_start in range(start, end, BLOCK_N):
                acc, l_i, m_i = _attend_key_tile(
                    q, acc, l_i, m_i, key_start, query_pos, cache_end, block_table, kv_head, scale_log2e,
                    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                    stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                    stride_scale_block, stride_scale_slot, stride_scale_head,
                    HEAD_DIM, HEAD_DIM_PADDED, BLOCK_SIZE, BLOCK_N, masked == 1, IEEE_FP32, FP8)
    if FRESH_KV:
        # The chunk's keys j (its token j) up to the tile's last query: those before the tile's
        # first query are seen by every row (no masks), the rest form the causal diagonal.
        if FP8 and not IEEE_FP32:
            q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # the chunk's keys are in the model's dtype
        chunk_keys = tl.where(seq_len > 0, tl.minimum(q_len, (tile_in_seq + 1) * BLOCK_Q), 0)
        if NUM_SPLITS > 1:
            chunk_keys = tl.where(is_last, chunk_keys, 0)
        first_query = tile_in_seq * BLOCK_Q
        unmasked_end = tl.minimum((first_query + 1) // BLOCK_N * BLOCK_N, chunk_keys)
        key_rows = key_ptr + q_start.to(tl.int64) * stride_key_token + kv_head * stride_key_head
        value_rows = value_ptr + q_start.to(tl.int64) * stride_value_token + kv_head * stride_value_head
        for key_start in range(0, unmasked_end, BLOCK_N):
            acc, l_i, m_i = _attend_fresh_tile(
                q, acc, l_i, m_i, key_start, token_in_chunk, chunk_keys, key_rows, value_rows, scale_log2e,
                stride_key_token, stride_value_token, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_N, False, IEEE_FP32)
        for key_start in range(unmasked_end, chunk_keys, BLOCK_N):
            acc, l_i, m_i = _attend_fresh_tile(
                q, acc, l_i, m_i, key_start, token_in_chunk, chunk_keys, key_rows, value_rows, scale_log2e,
                stride_key_token, stride_value_token, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_N, True, IEEE_FP32)

    writes_out = True
    if NUM_SPLITS > 1:
        writes_out = num_used == 1
        if num_used > 1:
            state = ((q_start + token_in_chunk).to(tl.int64) * num_heads + head) * NUM_SPLITS
            tl.store(partial_max_ptr + state + split, m_i, mask=row_valid)
            tl.store(partial_sum_ptr + state + split, l_i, mask=row_valid)
            tl.store(partial_out_ptr + (state + split)[:, None] * HEAD_DIM_PADDED + offs_d[None, :], acc,
                     mask=row_valid[:, None])
            # Every thread's stores before the count (its release), as a semaphore does.
            tl.debug_barrier()
            arrived = tl.atomic_add(arrivals_ptr + arrival, 1, sem="acq_rel", scope="gpu")
            writes_out = arrived == num_used - 1
            if writes_out:
                tl.store(arrivals_ptr + arrival, 0)
                acc, l_i = _merge_split_states(partial_out_ptr, partial_max_ptr, partial_sum_ptr, state, num_used,
                                               row_valid, offs_d, BLOCK_M, HEAD_DIM_PADDED)
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = (q_start + token_in_chunk).to(tl.int64) * stride_o_token + head * stride_o_head
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & d_valid[None, :] & writes_out)


# Which sequences a prefill launch takes (paged_attention): _paged_attention_kernel's WHICH_SEQS, all
# or those without a cached context; those with one go to _cached_prefill_kernel (CACHED_SEQS).
ALL_SEQS: tl.constexpr = tl.constexpr(0)
CACHED_SEQS: tl.constexpr = tl.constexpr(1)
FRESH_SEQS: tl.constexpr = tl.constexpr(2)


@triton.jit
def _paged_attention_kernel(
    out_ptr, query_ptr, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, num_active_seqs_ptr,
    scale_log2e, num_seqs, num_kv_heads,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_scale_block, stride_scale_slot, stride_scale_head,
    stride_block_table,
    partial_out_ptr, partial_max_ptr, partial_sum_ptr, arrivals_ptr, num_heads,
    HEADS_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE_FP32: tl.constexpr, FP8: tl.constexpr, FRESH_KV: tl.constexpr, ACTIVE_SEQS: tl.constexpr,
    SPLIT_DECODES: tl.constexpr, NUM_SPLITS: tl.constexpr, WHICH_SEQS: tl.constexpr = ALL_SEQS,
    JOINS_PREVIOUS: tl.constexpr = False,
):
    """SPLIT_DECODES: one-token sequences are the decode kernel's (else this kernel takes them too).
    NUM_SPLITS > 1 (program_id(1) is the split): a sequence's cached context, the whole key tiles
    before its chunk, is shared out among up to NUM_SPLITS programs per query tile, by its length
    (_context_splits): a short chunk after a long prefix would otherwise leave most SMs idle, its
    few tiles each walking the whole prefix. The last split also takes the rest (the causal
    diagonal, an FP8 chunk's own keys). Splits of a tile that has several write their partial
    softmax states ([token, head, split]) and count themselves in at arrivals_ptr[program_id(0)];
    the last to arrive merges the states, writes the output and sets the count back to 0, so no
    second kernel runs. A tile with one split writes its output as without splitting.
    FRESH_KV: the chunk's own keys and values come from key_ptr / value_ptr (this step's,
    [token, kv_head, dim]); only the context cached before the chunk is read from the cache.
    Otherwise every key comes from the cache. ACTIVE_SEQS: only sequences [0, *num_active_seqs_ptr)
    have tokens (a CUDA graph's padding); the tiles of the empty ones after them are not searched.
    WHICH_SEQS: ALL_SEQS, or only the sequences without a context cached before their chunk
    (FRESH_SEQS); the others' programs exit. (Those with one: _cached_prefill_kernel.)
    JOINS_PREVIOUS: launched with PDL beside the kernel before it (the cached chunks' launch, which
    lets it start at once), whose output it does not read. Its last program waits for that kernel
    first, so this grid ends after it: the kernels after this one wait for this grid only."""
    pid = tl.program_id(0)
    if JOINS_PREVIOUS:
        if pid == tl.num_programs(0) - 1:
            gdc_wait()
    # Programs run roughly in launch order, and a causal tile's work grows with its position, so
    # the last tiles go first (every KV head's) and the short ones fill the tail. Sequence s owns
    # tiles up to query_start_loc[s + 1] // BLOCK_Q + s, so the active ones own fewer than
    # num_tiles; the programs past those (the empty sequences', last in launch order) just exit.
    kv_head = pid % num_kv_heads
    if ACTIVE_SEQS:
        num_seqs = tl.load(num_active_seqs_ptr)
        num_tiles = tl.load(query_start_loc_ptr + num_seqs) // BLOCK_Q + num_seqs
    else:
        num_tiles = tl.num_programs(0) // num_kv_heads
    tile = num_tiles - 1 - pid // num_kv_heads
    if tile < 0:
        return
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_in_seq = tile - (q_start // BLOCK_Q + seq)
    # A one-token sequence (a decode) is the decode kernel's, which wastes no tile rows on it
    # (unless the step has no decode kernel: SPLIT_DECODES off).
    if tile_in_seq * BLOCK_Q >= q_len or (SPLIT_DECODES and q_len == 1):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step's chunk
    if WHICH_SEQS == FRESH_SEQS and context_len > 0:
        return
    split = 0
    num_used = 1
    context_tiles = 0
    if NUM_SPLITS > 1:
        split = tl.program_id(1)
        context_tiles = tl.maximum(context_len, 0) // BLOCK_N
        num_used = _context_splits(context_tiles, NUM_SPLITS)
        if split >= num_used:
            return
    _attend_query_tile(
        out_ptr, query_ptr, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_block_table, q_start, q_len, seq_len, tile_in_seq, kv_head,
        split, num_used, context_tiles, pid, scale_log2e,
        stride_q_token, stride_q_head, stride_o_token, stride_o_head,
        stride_key_token, stride_key_head, stride_value_token, stride_value_head,
        stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
        stride_scale_block, stride_scale_slot, stride_scale_head,
        partial_out_ptr, partial_max_ptr, partial_sum_ptr, arrivals_ptr, num_heads,
        HEADS_PER_KV, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_SIZE, BLOCK_Q, BLOCK_M, BLOCK_N,
        IEEE_FP32, FP8, FRESH_KV, NUM_SPLITS, not (FRESH_KV and WHICH_SEQS == FRESH_SEQS))


@triton.jit
def _cached_prefill_kernel(
    out_ptr, query_ptr, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, num_active_seqs_ptr,
    scale_log2e, num_seqs, num_kv_heads,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_scale_block, stride_scale_slot, stride_scale_head,
    stride_block_table,
    HEADS_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE_FP32: tl.constexpr, FP8: tl.constexpr, FRESH_KV: tl.constexpr, ACTIVE_SEQS: tl.constexpr,
    SPLIT_DECODES: tl.constexpr, MAX_SEQS: tl.constexpr, PDL: tl.constexpr = False,
):
    """The query tiles of the chunks after a cached context only (sequences with tokens this step
    and keys before them; not the decode kernel's one-token ones under SPLIT_DECODES), on as few
    programs as fill the GPU, each taking every num_programs-th (tile, KV head) in turn.

    In an FP8 step these are few (a long prompt's next chunk) among many fresh prompts, but the
    launch is sized for the worst case, every token a cached chunk's, and inside a CUDA graph it
    cannot be sized per step. Launched at one program per possible tile and head, ~4,000 programs
    (one an SM) mostly found their tile fresh and exited, ~30 waves of them, and the real tiles (an
    early sequence's, last in launch order) ran after those. Here each program reads the step's
    query_start_loc and seq_lens whole (MAX_SEQS >= num_seqs, a power of 2) and numbers the cached
    chunks' tiles [0, total); items (tile, head) go last tile first (the most causal keys), a
    tile's heads together.
    PDL: the next kernel (the fresh prompts' launch, JOINS_PREVIOUS) may start at once, on the SMs
    these programs leave: a step's few cached tiles (a cut prompt's next chunk, ~50 us a layer
    on 64 programs in the 256-request workload) would otherwise run with most SMs idle."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if ACTIVE_SEQS:
        num_seqs = tl.load(num_active_seqs_ptr)
    offs = tl.arange(0, MAX_SEQS)
    in_step = offs < num_seqs
    q_starts = tl.load(query_start_loc_ptr + offs, mask=in_step, other=0)
    q_lens = tl.load(query_start_loc_ptr + offs + 1, mask=in_step, other=0) - q_starts
    context_lens = tl.load(seq_lens_ptr + offs, mask=in_step, other=0) - q_lens
    takes = in_step & (context_lens > 0) & (q_lens > (1 if SPLIT_DECODES else 0))
    tiles = tl.where(takes, (q_lens + BLOCK_Q - 1) // BLOCK_Q, 0)
    tiles_through = tl.cumsum(tiles, 0)  # sequence s owns tiles [tiles_through[s] - tiles[s], tiles_through[s])
    total = tl.sum(tiles, 0)
    for item in range(pid, total * num_kv_heads, tl.num_programs(0)):
        tile = total - 1 - item // num_kv_heads
        kv_head = item % num_kv_heads
        seq = tl.sum((tiles_through <= tile).to(tl.int32), 0)  # the first whose tiles end past `tile`
        tile_in_seq = tile - tl.sum(tl.where(offs < seq, tiles, 0), 0)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        _attend_query_tile(
            out_ptr, query_ptr, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
            block_tables_ptr + seq.to(tl.int64) * stride_block_table, q_start, q_len, tl.load(seq_lens_ptr + seq),
            tile_in_seq, kv_head, 0, 1, 0, 0, scale_log2e,
            stride_q_token, stride_q_head, stride_o_token, stride_o_head,
            stride_key_token, stride_key_head, stride_value_token, stride_value_head,
            stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
            stride_scale_block, stride_scale_slot, stride_scale_head,
            out_ptr, out_ptr, out_ptr, out_ptr, 0,
            HEADS_PER_KV, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_SIZE, BLOCK_Q, BLOCK_M, BLOCK_N,
            IEEE_FP32, FP8, FRESH_KV, 1)


# A prefill split takes at least this many key tiles of its sequence's context.
MIN_TILES_PER_SPLIT: tl.constexpr = tl.constexpr(4)


@triton.jit
def _context_splits(context_tiles, NUM_SPLITS: tl.constexpr):
    """How many programs share a context of context_tiles whole key tiles: enough that each takes
    at least MIN_TILES_PER_SPLIT, at most NUM_SPLITS, at least 1."""
    return tl.maximum(tl.minimum(context_tiles // MIN_TILES_PER_SPLIT, NUM_SPLITS), 1)


@triton.jit
def _merge_split_states(partial_out_ptr, partial_max_ptr, partial_sum_ptr, state, num_used,
                        row_valid, offs_d, BLOCK_M: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr):
    """The unnormalized output and softmax sum of a tile's rows over all its splits' states
    (state: each row's first). Read past the L1 (.cg): other SMs wrote them."""
    m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_all = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    for s in range(0, num_used):
        m_s = tl.load(partial_max_ptr + state + s, mask=row_valid, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(partial_sum_ptr + state + s, mask=row_valid, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(partial_out_ptr + (state + s)[:, None] * HEAD_DIM_PADDED + offs_d[None, :],
                        mask=row_valid[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_all, m_s)
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no keys yet: both weights 0
        alpha = tl.math.exp2(m_all - base)
        beta = tl.math.exp2(m_s - base)
        acc_all = acc_all * alpha[:, None] + acc_s * beta[:, None]
        l_all = l_all * alpha + l_s * beta
        m_all = m_new
    return acc_all, l_all


@triton.jit
def _paged_decode_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    query_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, seq_order_ptr,
    scale_log2e,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_scale_block, stride_scale_slot, stride_scale_head,
    stride_block_table,
    # ROPE's: this step's k and v before RoPE, and what the rotation and the store take
    key_ptr, value_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, positions_ptr, slot_mapping_ptr, eps,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    HEADS_PER_KV: tl.constexpr, GROUP_PADDED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE_FP32: tl.constexpr,
    FP8: tl.constexpr, MIXED: tl.constexpr, ORDERED: tl.constexpr, PDL: tl.constexpr,
    ROPE: tl.constexpr, HAS_NORM: tl.constexpr, HALF_ROT: tl.constexpr, FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    """Decode-only steps (one query token per sequence): program (kv_head, seq, split) attends the
    HEADS_PER_KV query heads of that KV head (rows of a tensor-core tile padded to GROUP_PADDED)
    over split `split` of the sequence's keys. With one split it writes the output; with several
    (flash-decoding: a small batch of long contexts would otherwise leave most SMs idle) it writes
    its partial softmax state, and _combine_splits_kernel merges them.

    MIXED: a step with prefill chunks too, whose one-token sequences this kernel takes (their
    query row is query_start_loc[seq]; the others are _paged_attention_kernel's). One split only.

    ORDERED: the programs' y index is a position in seq_order (the sequences longest first), so
    that in a batch of many more programs than the GPU runs at once the long ones start first
    and the short ones fill the tail; a sequence's KV heads are neighbours on the grid's x.

    PDL (worker/pdl.py): the step's inputs (lengths, block tables) are read before waiting for the
    kernel before, which writes the query and the newest keys and values. Not with MIXED (whose
    programs may return before they would wait).

    ROPE: the query and this step's key come straight from the qkv projection, and the kernel does
    what ops.norm_rope would have done in a kernel of its own before it: each program norms and
    rotates its query heads, and the program whose split holds the sequence's newest key norms and
    rotates that key and writes it, with its value, to the cache before it reads its keys (the
    cache's slot is then what the store would have left there, e4m3 for an FP8 cache)."""
    if PDL:
        gdc_launch_dependents()
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    if ORDERED:
        seq = tl.load(seq_order_ptr + seq)
    split = tl.program_id(2)
    if MIXED:
        row = tl.load(query_start_loc_ptr + seq)
        if tl.load(query_start_loc_ptr + seq + 1) - row != 1:
            return
    else:
        row = seq
    seq_len = tl.load(seq_lens_ptr + seq)
    # Splits own whole tiles of BLOCK_N keys, so only the last tile of a sequence is partial.
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    key_lo = split * tiles_per_split * BLOCK_N
    key_hi = tl.minimum(seq_len, key_lo + tiles_per_split * BLOCK_N)
    if PDL:
        gdc_wait()

    offs_g = tl.arange(0, GROUP_PADDED)
    g_valid = offs_g < HEADS_PER_KV
    head = kv_head * HEADS_PER_KV + offs_g
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    d_valid = offs_d < HEAD_DIM
    if ROPE:
        position = tl.load(positions_ptr + row).to(tl.int64)
        q = normed_rotated_heads(query_ptr + row.to(tl.int64) * stride_q_token, head, stride_q_head, g_valid,
                                 offs_d, d_valid, q_norm_ptr, cos_ptr, sin_ptr, position, eps,
                                 HEAD_DIM, HALF_ROT, HAS_NORM)
        newest_split = (tl.cdiv(seq_len, BLOCK_N) - 1) // tl.maximum(tiles_per_split, 1)
        if (split == newest_split) & (seq_len > 0):
            kv_row = kv_head + tl.zeros([1], dtype=tl.int32)
            kv_valid = kv_row >= 0
            k_new = normed_rotated_heads(key_ptr + row.to(tl.int64) * stride_key_token, kv_row, stride_key_head,
                                         kv_valid, offs_d, d_valid, k_norm_ptr, cos_ptr, sin_ptr, position, eps,
                                         HEAD_DIM, HALF_ROT, HAS_NORM)
            v_new = tl.load(value_ptr + row.to(tl.int64) * stride_value_token + kv_row[:, None] * stride_value_head
                            + offs_d[None, :], mask=kv_valid[:, None] & d_valid[None, :], other=0.0)
            write_kv_heads(k_new, v_new, kv_row, kv_valid, offs_d, d_valid,
                           tl.load(slot_mapping_ptr + row).to(tl.int64), k_cache_ptr, v_cache_ptr,
                           k_scale_ptr, v_scale_ptr, stride_cache_block, stride_k_slot, stride_k_head,
                           stride_v_slot, stride_v_head, stride_scale_block, stride_scale_slot,
                           stride_scale_head, BLOCK_SIZE, FP8, FP8_MAX, MIN_SCALE)
        tl.debug_barrier()  # the keys read below include the one just written
    else:
        q = tl.load(query_ptr + row.to(tl.int64) * stride_q_token + head[:, None] * stride_q_head
                    + offs_d[None, :], mask=g_valid[:, None] & d_valid[None, :], other=0.0)
    if FP8:
        # e4m3 widens to float16 in one instruction per pair (to bfloat16 it takes a detour
        # through float32), so an FP8 cache's dots run in float16.
        q = q.to(tl.float16)

    m_i = tl.full([GROUP_PADDED], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PADDED], dtype=tl.float32)
    acc = tl.zeros([GROUP_PADDED, HEAD_DIM_PADDED], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for key_start in range(key_lo, key_hi, BLOCK_N):
        key_start = tl.multiple_of(key_start, BLOCK_N)  # splits own whole tiles
        offs_n = key_start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < key_hi
        block_index, slot = _tile_slots(key_start, BLOCK_SIZE, BLOCK_N)
        # whole blocks, for loads along the slots (an FP8 cache holds finite values only)
        block_valid = block_index * BLOCK_SIZE < key_hi
        block_ids = tl.load(block_table + block_index, mask=block_valid, other=0).to(tl.int64)
        block_base = block_ids * stride_cache_block
        k = tl.load(k_cache_ptr + (block_base + slot * stride_k_slot + kv_head * stride_k_head)[:, None] + offs_d[None, :],
                    mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        if IEEE_FP32:
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k).to(q.dtype))
        if FP8:  # each key's column of scores takes that key's scale
            scale_cols = block_ids * stride_scale_block + slot * stride_scale_slot + kv_head * stride_scale_head
            scores = scores * tl.load(k_scale_ptr + scale_cols, mask=block_valid).to(tl.float32)[None, :]
        scores = tl.where(n_valid[None, :], scores * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8:
            acc = acc * alpha[:, None] + _fp8_values_product(
                p, v_cache_ptr, v_scale_ptr, block_table, key_start, key_hi, block_base, slot, kv_head, scale_cols,
                offs_d, n_valid, block_valid, stride_cache_block, stride_v_slot, stride_v_head,
                HEAD_DIM, HEAD_DIM_PADDED, True, IEEE_FP32, q.dtype, BLOCK_SIZE, BLOCK_N)
        else:
            v = tl.load(v_cache_ptr + (block_base + slot * stride_v_slot + kv_head * stride_v_head)[:, None]
                        + offs_d[None, :], mask=n_valid[:, None] & d_valid[None, :], other=0.0)
            if IEEE_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    out_mask = g_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_rows = row.to(tl.int64) * stride_o_token + head * stride_o_head
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # partial state, [seq, head, split]; an empty split leaves max -inf and sum 0
        state = (seq.to(tl.int64) * (HEADS_PER_KV * tl.num_programs(0)) + head) * NUM_SPLITS + split
        tl.store(partial_max_ptr + state, m_i, mask=g_valid)
        tl.store(partial_sum_ptr + state, l_i, mask=g_valid)
        tl.store(partial_out_ptr + state[:, None] * HEAD_DIM_PADDED + offs_d[None, :], acc, mask=out_mask)


@triton.jit
def _combine_splits_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, stride_o_token, stride_o_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (sequence, query head): merge the splits' softmax states (each rescaled to
    the overall max) into the output.

    PDL (worker/pdl.py): everything it reads is the attention kernel's, so it waits at once; but it
    lets the kernel after it (o_proj) start first, to load its weights while the attention runs
    (batch 1 on an H100: 0.944 -> 0.880 ms per token)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    state = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(partial_max_ptr + state)
    l_ = tl.load(partial_sum_ptr + state)
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # nothing to attend (a padding row)
    weight = tl.math.exp2(m - m_all)
    total = tl.sum(l_ * weight, axis=0)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    acc = tl.load(partial_out_ptr + state[:, None] * HEAD_DIM_PADDED + offs_d[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_token + head * stride_o_head + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def store_kv_args(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  layout: KVCacheLayout | None = None) -> tuple[tuple, dict]:
    """store_token_kv's arguments after `token` (positional) and its constants (by name), for a
    kernel that stores key/value [num_tokens, num_kv_heads, head_dim] into this cache."""
    layout = layout if layout is not None else plain_layout(kv_cache)
    views = layout.split(kv_cache)
    _, num_kv_heads, head_dim = key.shape
    k_scale, v_scale = _scales(views)
    args = (key, value, views.key, views.value, k_scale, v_scale, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), *cache_strides(views))
    constants = dict(NUM_KV_HEADS=num_kv_heads, KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
                     HEAD_DIM=head_dim, HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
                     BLOCK_SIZE=layout.block_size, FP8=layout.fp8, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE)
    return args, constants


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             layout: KVCacheLayout | None = None) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] to their slots (slot -1: skip)."""
    args, constants = store_kv_args(key, value, kv_cache, slot_mapping, layout)
    _store_kv_kernel[(key.shape[0],)](*args, **constants)


def _scales(views: KVCacheViews) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale tensors; for a plain cache, unused stand-ins."""
    if views.key_scale is None:
        return views.key, views.value
    return views.key_scale, views.value_scale


def cache_strides(views: KVCacheViews) -> tuple[int, ...]:
    """The kernels' cache strides, in elements: (block, key slot, key head, value slot, value
    head, scale block, scale slot, scale head). A key's dims are contiguous, and so are a value's
    (kv_cache.py), so neither has a dim stride. K and V (and their scales) share the block stride:
    they are rows of one tensor."""
    key, value = views.key, views.value
    assert key.stride(3) == 1 and value.stride(3) == 1 and key.stride(0) == value.stride(0)
    if views.key_scale is not None:  # a head's values in a block are one run (_fp8_value_runs reads them so)
        assert value.stride(1) == value.shape[3], "FP8 values must be [head, slot, dim] in a block"
    scale = (0, 0, 0) if views.key_scale is None else views.key_scale.stride()
    return (key.stride(0), key.stride(1), key.stride(2), value.stride(1), value.stride(2), *scale)


STORE_KV_STRIDES = 12  # store_token_kv's stride arguments: the key's and value's 2 each, then cache_strides


class PrefillConfig(NamedTuple):
    block_m: int = 128  # query rows per tile (tokens x the query heads of one KV head)
    block_n: int = 64  # keys per tile
    num_warps: int = 8
    num_stages: int = 4
    # A register cap per thread (None: the compiler's choice). Left to itself the compiler takes
    # 136 at these shapes when the sequence count is not the constant 1 (a CUDA graph's batch),
    # and the kernel runs at half the speed.
    maxnreg: int | None = 128


# Tuned on an H100 (benchmarks/tune_attention.py) for 16-bit queries with heads of up to 128 dims;
# float32 queries (exactness runs) and wider heads take smaller tiles to fit shared memory.
PREFILL = PrefillConfig()
PREFILL_SMALL = PrefillConfig(64, 64, 4, 2, None)
# An FP8 cache's tiles are widened to float16 on their way to the tensor cores, which takes
# registers the 128 cap would spill: one 8,192-token prompt in 1.33 ms against 1.96 with PREFILL's
# shape (H100, benchmarks/results/2026-11-25-h100-fp8-decode/). With the chunk's own keys read
# unquantized (paged_attention) the same prompt takes 0.76 ms at 3 stages.
PREFILL_FP8 = PrefillConfig(128, 128, 8, 3, None)
# Steps of few tokens fill the GPU with smaller tiles, whatever their sequences' lengths (H100, in
# CUDA graphs, `tune_attention.py --cudagraph`): one 128-token prompt 11 -> 8 us, one of 1,024 33 ->
# 28 (FP8 34 -> 32), one of 2,048 69 -> 58 (FP8 even), eight of 128 15 -> 12 (FP8 21 -> 15). From
# 4,096 tokens PREFILL's shape is ahead again. (A token count picks the same shape eagerly and in its
# graph's bucket: the limits are bucket sizes.)
PREFILL_TINY = PrefillConfig(16, 64, 4, 2, None)  # steps of up to 128 tokens
PREFILL_SHORT = PrefillConfig(64, 64, 4, 3, None)  # up to 2,048 (FP8: 1,024)


def prefill_config(num_tokens: int, dtype: torch.dtype, head_dim: int, fp8: bool,
                   splits: bool = False) -> PrefillConfig:
    """The prefill kernel's tile shape for a step of num_tokens query tokens (`splits`: whose
    contexts are shared out, paged_attention's num_splits > 1)."""
    if dtype == torch.float32 or head_dim > 128:
        return PREFILL_SMALL
    # Each query tile reads its sequence's whole context, so after a long prefix fewer, taller
    # tiles win: 128 new tokens after 16k cached, 198 us a layer in 16-row tiles against 76 in
    # 64-row ones (437 unsplit); a fresh 128-token prompt 6 against 7 (H200, in CUDA graphs).
    if splits:
        return PREFILL_SHORT
    if num_tokens <= 128:
        return PREFILL_TINY
    if num_tokens <= (1024 if fp8 else 2048):
        return PREFILL_SHORT
    return PREFILL_FP8 if fp8 else PREFILL


# An FP8 cache's prefill reads a chunk's own keys from the step's key/value ("0": from the cache).
PREFILL_FRESH_KV = os.environ.get("MINIVLLM_PREFILL_FRESH_KV", "1") != "0"
# ... and a large step's sequences without a cached context run on the plain kernel, at this shape
# ($MINIVLLM_PREFILL_FRESH_SEQS_PLAIN=0: every sequence on the FP8 kernel, for measuring). H100, in
# CUDA graphs, 16,384 tokens of 100-1,024-token prompts: 218 us a layer against 324 on the FP8
# kernel alone (bf16 cache: 194; PREFILL's shape here 273); 8,192 of 562-token prompts 102 against 156.
# Compiled without the cache loops (its sequences have no context), 64-row tiles on 4 warps won:
# 189 us against 198 for (128, 32, 8, 3, 128), and 252 against 260 with a cut prompt's next chunk
# beside it (benchmarks/results/2026-11-27-scale-bound/).
PREFILL_FRESH_SEQS_PLAIN = os.environ.get("MINIVLLM_PREFILL_FRESH_SEQS_PLAIN", "1") != "0"
PREFILL_FP8_FRESH = PrefillConfig(64, 32, 4, 3, None)
# ... and runs beside the cached chunks' launch, which goes first ($MINIVLLM_PREFILL_JOINS=0: one
# after the other, for measuring; without PDL they always do). In the 256-request workload's prompt
# step, with a cut prompt's next chunk, 261 us a layer against 295 (H100, CUDA graphs, the fresh
# launch at (128, 32, 8, 3, 128) both ways; 250 at its shape now, against 304 at the session's start).
PREFILL_JOINS = os.environ.get("MINIVLLM_PREFILL_JOINS", "1") != "0"
# The cached chunks' kernel's programs (_cached_prefill_kernel), per SM. PREFILL_FP8's shape fits
# one program an SM, so two give each SM a second while the first finishes its last tile. H100, in
# CUDA graphs: one 8,192-token chunk after 8,192 cached, 3,198 us against 3,257-3,261 at one; the
# 256-request workload's prompt step even (benchmarks/results/2026-11-27-fp8-prefill/).
CACHED_PREFILL_PROGRAMS_PER_SM = 2


class DecodeConfig(NamedTuple):
    block_n: int = 64  # keys per tile
    num_warps: int = 4
    num_stages: int = 3
    maxnreg: int | None = None  # a register cap per thread (None: the compiler's choice)
    # Most splits per sequence (1: no split-KV); $MINIVLLM_DECODE_MAX_SPLITS overrides, for measuring.
    max_splits: int = int(os.environ.get("MINIVLLM_DECODE_MAX_SPLITS", 16))
    # Large batches run their longest sequences first ($MINIVLLM_DECODE_LONGEST_FIRST=0: in
    # order, for measuring).
    longest_first: bool = os.environ.get("MINIVLLM_DECODE_LONGEST_FIRST", "1") != "0"


# Tuned on an H100 (benchmarks/tune_attention.py): the best shapes for a plain and an FP8 cache.
DECODE = DecodeConfig()
# ... and for a plain cache's steps of fewer than DECODE_FEW_SEQS sequences: 2 stages, 9-17% faster
# where a shrinking batch's 34-100 sequences (too many to split their keys) hold long contexts
# (151 against 166 us a layer at 80 sequences of 850-1,774 keys, 111 against 134 at 50 of
# 950-1,874; H100, in CUDA graphs), and at batch 1 (0.817 ms a token against 0.874). At 256
# sequences the kernel alone is as fast at 2 stages, but the 256-request workload ran 0.6% slower
# with it (three alternating pairs, two H100s): benchmarks/results/2026-11-27-scale-bound/.
DECODE_FEW = DecodeConfig(num_stages=2)
DECODE_FEW_SEQS = 128


def decode_config(num_seqs: int, fp8: bool) -> DecodeConfig:
    """The decode kernel's default shape for a step of num_seqs sequences (a CUDA graph's: padded)."""
    return DECODE_FP8 if fp8 else DECODE_FEW if num_seqs < DECODE_FEW_SEQS else DECODE


# Most splits for contexts of up to DECODE_LONG_CONTEXT keys (benchmarks/decode_splits.py).
SHORT_CONTEXT_MAX_SPLITS = 8
# FP8: since values are read as whole runs (_fp8_value_runs), 64-key tiles on 2 warps: the 256-request
# workload 33,478 / 33,696 output tok/s against 32,998 / 32,995 for (128 keys, 4 warps, 2 stages,
# 128 registers), alternating on one H100 (benchmarks/results/2026-11-26-h100-fp8-values/, values
# then stored transposed, also as one run a head). Steps that large now go to fp8_decode.cu; this
# kernel takes the FP8 steps of fewer sequences.
DECODE_FP8 = DecodeConfig(block_n=64, num_warps=2, num_stages=3)


def num_kv_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Splits per sequence for a decode step: 1 when the batch's (sequence, KV head) programs fill
    the GPU a few times over by themselves, else the power of two that brings them near 4 per SM.
    It depends on the batch's shape only, never on its lengths (the host knows those only for eager
    steps; a CUDA graph bakes the count in)."""
    splits = 1
    while splits < max_splits and num_seqs * num_kv_heads * splits * 2 <= 4 * num_sms:
        splits *= 2
    return splits


def _num_sms(device: torch.device) -> int:
    """The device's multiprocessor count, which grids are sized by (2 on the CPU, where Triton's
    interpreter runs the kernels for tests: few programs, so that loops over tiles and splits run)."""
    return pdl.num_sms(device.index or 0) if device.type == "cuda" else 2


def decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
    out: torch.Tensor | None = None, config: DecodeConfig | None = None, num_splits: int | None = None,
    mixed: bool = False, rope: RopeInputs | None = None,
) -> torch.Tensor:
    """Attention for a decode-only step (metadata.max_query_len == 1: row i is sequence i's token),
    or, with `mixed`, for the one-token sequences of a step with prefill chunks (the rest of `out`
    is left to the prefill kernel).

    rope (decode-only steps): `query` and rope.key are the qkv projection's, before the per-head
    norm and RoPE, and this step's K/V are not in the cache yet: the kernel norms and rotates them
    and stores k and v itself (no norm_rope kernel before it).

    FP8 caches: steps of at least fp8_decode.MIN_SEQS sequences (mixed ones too) go to the CUDA
    kernel (fp8_decode.py) where it serves; with `rope`, ops.norm_rope rotates q and k in place and
    stores this step's K/V before it."""
    num_tokens, num_heads, head_dim = query.shape
    layout = metadata.layout(kv_cache)
    num_kv_heads = layout.num_kv_heads
    heads_per_kv = num_heads // num_kv_heads
    num_seqs = metadata.num_seqs
    if out is None:
        out = torch.empty_like(query)
    if config is None:
        config = decode_config(num_seqs, layout.fp8)
    if mixed:
        if rope is not None:
            raise ValueError("rope: decode-only steps (a mixed step rotates in ops.norm_rope)")
        num_splits = 1
    elif num_splits is None:
        # A small batch splits its keys whatever their length: at batch 1 over 128-1,024 keys, 8
        # splits take 5.3-8.0 us a layer against 6.0-24.8 for one (merge included; H100, in a
        # graph). Beyond 8 only long contexts gain from more.
        max_splits = config.max_splits if metadata.max_seq_len > DECODE_LONG_CONTEXT else \
            min(config.max_splits, SHORT_CONTEXT_MAX_SPLITS)
        num_splits = num_kv_splits(num_seqs, num_kv_heads, _num_sms(query.device), max_splits)
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim_padded, dtype=torch.float32,
                                  device=query.device)
        partial_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out  # unused
    views = layout.split(kv_cache)
    # Longest sequences first when the programs come in several waves (not in a mixed step, whose
    # grid also spans the prefill sequences).
    seq_order = None
    if not mixed and num_splits == 1 and config.longest_first and \
            num_seqs * num_kv_heads > _num_sms(query.device):
        seq_order = metadata.longest_first()
    if fp8_decode.supports(query, layout, num_seqs):  # the CUDA kernel (fp8_decode.py)
        if rope is not None:  # the kernel takes q rotated and this step's K/V stored: ops.norm_rope first
            from minivllm.worker import ops  # (ops imports this module)

            query, _ = ops.norm_rope(query, rope.key, rope.positions, rope.cos_cache, rope.sin_cache, rope.q_norm,
                                     rope.k_norm, rope.eps, kv_store=(rope.value, kv_cache, metadata.slot_mapping, layout))
        fp8_decode.decode(query, views, layout, metadata, scale, out, num_splits, seq_order, partial_out, partial_max,
                          partial_sum, mixed=mixed)
        if num_splits > 1:
            _combine_splits(out, partial_out, partial_max, partial_sum, head_dim)
        return out
    k_scale, v_scale = _scales(views)
    group_padded = max(16, triton.next_power_of_2(heads_per_kv))  # a tensor-core tile has >= 16 rows
    if rope is not None:
        key, value = rope.key, rope.value
        if query.stride(2) != 1 or key.stride(2) != 1 or value.stride(2) != 1:
            raise ValueError("rope: query, key and value need unit stride along head_dim")
        rope_args = (key, value, rope.q_norm if rope.q_norm is not None else query,
                     rope.k_norm if rope.k_norm is not None else query, rope.cos_cache, rope.sin_cache,
                     rope.positions, metadata.slot_mapping, rope.eps,
                     key.stride(0), key.stride(1), value.stride(0), value.stride(1))
        half_rot = rope.cos_cache.shape[-1]
    else:  # unused stand-ins
        rope_args, half_rot = (query,) * 8 + (0.0, 0, 0, 0, 0), 1
    _paged_decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        out, partial_out, partial_max, partial_sum,
        query, views.key, views.value, k_scale, v_scale,
        metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
        seq_order if seq_order is not None else metadata.seq_lens,
        scale * 1.4426950408889634,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), *cache_strides(views),
        metadata.block_tables.stride(0), *rope_args,
        HEADS_PER_KV=heads_per_kv, GROUP_PADDED=group_padded, HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=layout.block_size, BLOCK_N=config.block_n, NUM_SPLITS=num_splits,
        IEEE_FP32=query.dtype == torch.float32, FP8=layout.fp8, MIXED=mixed, ORDERED=seq_order is not None,
        ROPE=rope is not None, HAS_NORM=rope is not None and rope.q_norm is not None, HALF_ROT=half_rot,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **({} if config.maxnreg is None else {"maxnreg": config.maxnreg}),
        **(pdl.OFF if mixed else pdl.launch_options(query.device)),
    )
    if num_splits > 1:
        _combine_splits(out, partial_out, partial_max, partial_sum, head_dim)
    return out


def _combine_splits(out: torch.Tensor, partial_out: torch.Tensor, partial_max: torch.Tensor,
                    partial_sum: torch.Tensor, head_dim: int) -> None:
    """Merge a decode step's split states (partial_out [seq, head, split, head_dim_padded]) into out."""
    num_seqs, num_heads, num_splits, head_dim_padded = partial_out.shape
    _combine_splits_kernel[(num_seqs, num_heads)](
        out, partial_out, partial_max, partial_sum, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, NUM_SPLITS=num_splits,
        **pdl.launch_options(out.device),
    )


# Most programs that share a short chunk's context (metadata.step_splits_contexts).
PREFILL_SPLITS = 8


class _SplitScratch(NamedTuple):
    """What the prefill kernel's context splits write: partial states [token, head, split] (values,
    maxima, sums) for up to `tokens` tokens, and one arrival count per program (kept at 0)."""

    tokens: int
    partial_out: torch.Tensor
    partial_max: torch.Tensor
    partial_sum: torch.Tensor
    arrivals: torch.Tensor


# (device, heads, splits, padded head dim) -> scratch. Every layer and every graph of the process
# takes its turn with the same one (one stream). One that grows leaves the old in _RETIRED_SCRATCH:
# a graph captured with it may still use it. (Qwen3-0.6B's: 17 MB, allocated at the first graph's
# warm-up; like the graphs' pool it is not in the KV cache's profiled budget.)
_SPLIT_SCRATCH: dict[tuple, _SplitScratch] = {}
_RETIRED_SCRATCH: list[_SplitScratch] = []


def _split_scratch(num_tokens: int, num_heads: int, num_splits: int, head_dim_padded: int, num_programs: int,
                   device: torch.device) -> _SplitScratch:
    key = (device, num_heads, num_splits, head_dim_padded)
    scratch = _SPLIT_SCRATCH.get(key)
    if scratch is not None and scratch.tokens >= num_tokens and scratch.arrivals.numel() >= num_programs:
        return scratch
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # (What a capture allocates is its graph pool's, which other graphs' tensors reuse.)
        raise RuntimeError("prefill split scratch first asked for inside a CUDA graph capture: run the step's "
                           "shape eagerly first")
    tokens = max(num_tokens, FEW_SEQS_SPLIT_MAX_TOKENS, scratch.tokens if scratch else 0)
    # (A tile of a sequence holds at least one token, so a step has at most tokens + sequences tiles.)
    programs = max(num_programs, 2 * tokens * num_heads)
    partial_max = torch.empty(tokens, num_heads, num_splits, dtype=torch.float32, device=device)
    new = _SplitScratch(tokens, torch.empty(tokens, num_heads, num_splits, head_dim_padded, dtype=torch.float32,
                                            device=device),
                        partial_max, torch.empty_like(partial_max),
                        torch.zeros(programs, dtype=torch.int32, device=device))
    if scratch is not None:
        _RETIRED_SCRATCH.append(scratch)
    _SPLIT_SCRATCH[key] = new
    return new


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
    out: torch.Tensor | None = None, config: PrefillConfig | None = None,
    key: torch.Tensor | None = None, value: torch.Tensor | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] -> out [num_tokens, num_heads, head_dim]. A
    decode-only step goes to the decode kernel; a step with prefill chunks to the prefill kernel
    (`config`: its tile shape), whose one-token sequences the decode kernel takes.

    key, value [num_tokens, num_kv_heads, head_dim]: this step's, in the query's dtype (already in
    the cache too). With an FP8 cache the prefill kernel reads each chunk's own keys from them,
    unquantized, and only the context before the chunk from the cache: e4m3 tiles are widened on
    their way to the tensor cores, which made an FP8 prefill 2.3x slower than a bfloat16 one, and
    the chunk's attention is more accurate for it. (A 16-bit cache holds exactly these values, and
    the second set of pipelined tiles would take the shared memory a second program per SM needs:
    measured slower, so it reads the cache.) $MINIVLLM_PREFILL_FRESH_KV=0: the cache always.

    num_splits: the most programs that may share a sequence's cached context (None: PREFILL_SPLITS
    where metadata.step_splits_contexts says so, else 1); more than 1 needs split_decodes False.

    Long-context prefill steps on Hopper GPUs go to the CUDA kernel of hopper_prefill.py instead
    (hopper_prefill.supports; not when `config` names a Triton shape)."""
    if metadata.max_query_len == 1:
        return decode_attention(query, kv_cache, metadata, scale, out=out)
    if metadata.split_decodes:
        out = decode_attention(query, kv_cache, metadata, scale, out=out, mixed=True)
    elif out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    layout = metadata.layout(kv_cache)
    block_size, num_kv_heads = layout.block_size, layout.num_kv_heads
    heads_per_kv = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = PREFILL_SPLITS if step_splits_contexts(metadata.split_decodes, num_tokens) else 1
    if num_splits > 1 and metadata.split_decodes:
        raise ValueError("num_splits > 1 needs metadata.split_decodes False (the decode kernel's rows are not split)")
    if config is None and num_splits == 1 and hopper_prefill.supports(query, layout, metadata):
        return hopper_prefill.prefill_attention(query, kv_cache, layout, metadata, scale, out)
    views = layout.split(kv_cache)
    fresh_kv = key is not None and value is not None and layout.fp8 and PREFILL_FRESH_KV
    if fresh_kv and (key.stride(2) != 1 or value.stride(2) != 1 or key.dtype != query.dtype):
        raise ValueError("key and value must be [num_tokens, num_kv_heads, head_dim] with unit stride along "
                         f"head_dim, in the query's dtype ({query.dtype})")
    if not fresh_kv:
        key = value = query  # unused
    # Each launch: (tile shape, whether it reads an FP8 cache, which sequences it takes).
    default_shape = config is None
    if default_shape:
        config = prefill_config(num_tokens, query.dtype, head_dim, layout.fp8, num_splits > 1)
    launches = [(config, layout.fp8, ALL_SEQS)]
    if default_shape and fresh_kv and config is PREFILL_FP8 and num_splits == 1 and PREFILL_FRESH_SEQS_PLAIN:
        # A large step's fresh prompts never read the e4m3 cache, yet in the FP8 kernel they run
        # at its shape and register budget (255 registers, one program an SM). They go to the
        # plain kernel (without its cache loops), the chunks after a cached context to the FP8 one
        # (_cached_prefill_kernel, a few programs that look only at those). That one goes first,
        # and with PDL the fresh prompts' launch runs beside it (JOINS_PREVIOUS).
        launches = [(config, True, CACHED_SEQS), (PREFILL_FP8_FRESH, False, FRESH_SEQS)]
    joins = len(launches) > 1 and PREFILL_JOINS and pdl.enabled(query.device)
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    for tiles, fp8, which in launches:
        block_m = max(tiles.block_m, triton.next_power_of_2(heads_per_kv))
        block_q = max(1, block_m // heads_per_kv)
        # One program per possible tile and KV head (those past the step's tiles exit), or for
        # the cached chunks' kernel as many as fill the GPU, each looping over tiles.
        num_programs = (num_tokens // block_q + metadata.num_seqs) * num_kv_heads
        if which == CACHED_SEQS:
            num_programs = min(num_programs, CACHED_PREFILL_PROGRAMS_PER_SM * _num_sms(query.device))
        # (A launch without the FP8 cache's loads is compiled as a plain cache's: this step's own
        # key and value stand in for the cache and its scales, never read there.)
        k_cache, v_cache = (views.key, views.value) if fp8 or not layout.fp8 else (key, value)
        k_scale, v_scale = _scales(views) if fp8 else (k_cache, v_cache)
        args = (out, query, key, value, k_cache, v_cache, k_scale, v_scale,
                metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                metadata.num_active_seqs if metadata.num_active_seqs is not None else metadata.seq_lens,
                scale * 1.4426950408889634, metadata.num_seqs, num_kv_heads,
                query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                key.stride(0), key.stride(1), value.stride(0), value.stride(1), *cache_strides(views),
                metadata.block_tables.stride(0))
        shape = dict(HEADS_PER_KV=heads_per_kv, HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded,
                     BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=tiles.block_n,
                     IEEE_FP32=query.dtype == torch.float32, FP8=fp8, FRESH_KV=fresh_kv,
                     ACTIVE_SEQS=metadata.num_active_seqs is not None, SPLIT_DECODES=metadata.split_decodes,
                     num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                     **({} if tiles.maxnreg is None else {"maxnreg": tiles.maxnreg}))
        if which == CACHED_SEQS:
            # (At least 512: one build serves every eager step's sequence count and the mixed
            # graphs' max_num_seqs + 1 up to 512, where each power of 2 would be a build of its own.)
            _cached_prefill_kernel[(num_programs,)](
                *args, MAX_SEQS=max(512, triton.next_power_of_2(metadata.num_seqs)), PDL=joins, **shape)
            continue
        if num_splits > 1:
            scratch = _split_scratch(num_tokens, num_heads, num_splits, head_dim_padded, num_programs, query.device)
            splits_args = (scratch.partial_out, scratch.partial_max, scratch.partial_sum, scratch.arrivals, num_heads)
        else:
            splits_args = (out,) * 4 + (num_heads,)  # unused
        _paged_attention_kernel[(num_programs, num_splits)](
            *args, *splits_args, NUM_SPLITS=num_splits, WHICH_SEQS=which, **shape,
            **(dict(JOINS_PREVIOUS=True, launch_pdl=True) if joins and which == FRESH_SEQS else {}))
    return out


class TritonAttentionBackend(AttentionBackend):
    """The CUDA backend: store K/V (with its own kernel, or inside the RoPE kernel, which saves a
    launch per layer), attend with the prefill and decode kernels; a decode-only step's norm, RoPE
    and store run inside the decode kernel (another launch a layer fewer)."""

    name = "triton"
    # $MINIVLLM_ROPE_STORES_KV=0 keeps the store's own kernel (for measuring the fusion).
    stores_kv_with_rope = os.environ.get("MINIVLLM_ROPE_STORES_KV", "1") != "0"
    # $MINIVLLM_DECODE_ROPE=0 keeps RoPE in its own kernel at decode too (for measuring).
    rotates_in_decode = os.environ.get("MINIVLLM_DECODE_ROPE", "1") != "0"

    def decode_rotating(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                        scale: float, rope: RopeInputs) -> torch.Tensor:
        return decode_attention(query, kv_cache, metadata, scale, rope=rope)

    def store(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              metadata: AttentionMetadata) -> None:
        store_kv(key, value, kv_cache, metadata.slot_mapping, metadata.layout(kv_cache))

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
        """(An FP8 cache's prefill chunks attend their own keys from key and value: paged_attention.)"""
        return paged_attention(query, kv_cache, metadata, scale, key=key, value=value)
