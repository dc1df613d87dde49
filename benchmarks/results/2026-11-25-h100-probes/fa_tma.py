"""Experiment: causal prefill attention over contiguous K/V through TMA descriptors, GQA rows packed
as the engine's kernel packs them (row m = token m // G, head m % G of one KV head), with and without
Triton's warp specialization. One sequence, [S, H, D] bf16."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(q, acc, l_i, m_i, desc_k, desc_v, key_start, kv_col, q_tok, scale_log2e,
          BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    k = desc_k.load([key_start, kv_col])
    s = tl.dot(q, k.T)
    if MASKED:
        offs_n = key_start + tl.arange(0, BLOCK_N)
        s = tl.where(offs_n[None, :] <= q_tok[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2e)
    p = tl.math.exp2(s * scale_log2e - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = desc_v.load([key_start, kv_col])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def fa_kernel(desc_q, desc_k, desc_v, desc_o, num_tokens, num_kv_heads, scale_log2e,
              G: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
              WS: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = pid % num_kv_heads
    num_tiles = (num_tokens + BLOCK_Q - 1) // BLOCK_Q
    tile = num_tiles - 1 - pid // num_kv_heads
    q0 = tile * BLOCK_Q
    BLOCK_M: tl.constexpr = BLOCK_Q * G
    q = desc_q.load([q0, kv_head * G * D]).reshape(BLOCK_M, D)
    q_tok = q0 + tl.arange(0, BLOCK_M) // G
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kv_col = kv_head * D
    unmasked_end = q0 // BLOCK_N * BLOCK_N
    for key_start in tl.range(0, unmasked_end, BLOCK_N, warp_specialize=WS):
        acc, l_i, m_i = _tile(q, acc, l_i, m_i, desc_k, desc_v, key_start, kv_col, q_tok, scale_log2e,
                              BLOCK_N, False)
    for key_start in tl.range(unmasked_end, q0 + BLOCK_Q, BLOCK_N):
        acc, l_i, m_i = _tile(q, acc, l_i, m_i, desc_k, desc_v, key_start, kv_col, q_tok, scale_log2e,
                              BLOCK_N, True)
    acc = acc / l_i[:, None]
    desc_o.store([q0, kv_head * G * D], acc.to(desc_o.dtype).reshape(BLOCK_Q, G * D))


def attention(q, k, v, out, block_q=64, block_n=64, num_warps=8, num_stages=3, ws=False, maxnreg=None):
    from triton.tools.tensor_descriptor import TensorDescriptor
    S, H, D = q.shape
    KVH = k.shape[1]
    G = H // KVH
    q2, o2 = q.view(S, H * D), out.view(S, H * D)
    k2, v2 = k.view(S, KVH * D), v.view(S, KVH * D)
    dq = TensorDescriptor.from_tensor(q2, [block_q, G * D])
    do = TensorDescriptor.from_tensor(o2, [block_q, G * D])
    dk = TensorDescriptor.from_tensor(k2, [block_n, D])
    dv = TensorDescriptor.from_tensor(v2, [block_n, D])
    grid = (triton.cdiv(S, block_q) * KVH,)
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    fa_kernel[grid](dq, dk, dv, do, S, KVH, D ** -0.5 * 1.4426950408889634, G=G, D=D, BLOCK_Q=block_q,
                    BLOCK_N=block_n, WS=ws, num_warps=num_warps, num_stages=num_stages, **extra)
    return out
