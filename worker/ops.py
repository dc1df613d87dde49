"""The model's element-wise steps, each one kernel on CUDA (Triton) and plain torch elsewhere.

Written op by op in torch, an RMSNorm is ~7 kernels, RoPE on q and k ~20 and SiLU-and-mul 2;
a decoder layer launches ~60 kernels, most of them reading and writing the whole activation
again. On CUDA each op here is one kernel that reads its inputs once:

  add_rms_norm     residual += x (optional), then RMSNorm(residual) * weight
  norm_rope        per-head RMSNorm (Qwen3's q/k norm, optional) then rotary embedding, of q
                   and k in place, one program per token; optionally it then writes the token's
                   k and v into the paged KV cache (the attention backend's store, fused)
  silu_and_mul     silu(gate) * up from the fused gate|up projection

The torch versions are the reference (and the CPU path); they follow HF's order of operations
(statistics in fp32, cast back before the weight) so CPU results stay token-exact with HF.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.worker import hopper_gemm, pdl

try:
    import triton
    import triton.language as tl

    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from minivllm.worker.attention.triton_attention import (STORE_KV_STRIDES, normed_rotated_heads, store_kv_args,
                                                             store_token_kv)
except ImportError:  # CPU-only torch builds have no Triton: the torch versions serve
    triton = None


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


# ---------------------------------------------------------------- torch references


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(input_dtype)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim]; cos/sin [tokens, rotary_dim // 2] (fp32). GPT-NeoX layout:
    the first and second halves of the rotary dims form the pairs."""
    rotary_dim = 2 * cos.shape[-1]
    rot, passthrough = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated, passthrough), dim=-1) if passthrough.numel() else rotated


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_reference's operations, in its order and dtypes (so the same bits), on fewer
    buffers: on a CPU each fresh activation-sized buffer costs about as much as an operation on it
    (its pages are faulted in anew). x itself is never written."""
    xf = x.float()
    variance = xf.square().mean(-1, keepdim=True)  # (square is pow(2)'s own kernel)
    rstd = torch.rsqrt(variance.add_(eps))
    normed = xf * rstd if xf is x else xf.mul_(rstd)
    normed = normed.to(x.dtype)
    if weight.dtype != normed.dtype:  # the reference's product promotes: keep its dtype
        return weight * normed
    return normed.mul_(weight)


def rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope_reference's products, sums and dtypes (the same bits), written into one output instead
    of concatenated from temporaries."""
    half = cos.shape[-1]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:2 * half]
    out = torch.empty_like(x)
    first, second = out[..., :half], out[..., half:2 * half]
    torch.mul(x1, cos, out=first)
    first.sub_(x2 * sin)
    torch.mul(x2, cos, out=second)
    second.add_(x1 * sin)
    if 2 * half < x.shape[-1]:
        out[..., 2 * half:] = x[..., 2 * half:]
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1). On the CPU through max(dim=-1): the same indices (the first of equal
    maxima; a NaN's, as argmax gives) from a kernel 3-5x faster there (64 rows of 49,152 logits on
    a 2-core Sapphire Rapids: bf16 5.8 -> 1.2 ms, fp32 2.4 -> 0.9)."""
    return x.max(dim=-1).indices if x.device.type == "cpu" else x.argmax(dim=-1)


# ---------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, residual_ptr, out_ptr, weight_ptr, stride_x, stride_r, stride_o, eps,
                             N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        if PDL:  # (worker/pdl.py, hopper_gemm.starts_early) the projection after may load its weights
            gdc_launch_dependents()
        w = tl.load(weight_ptr + offs, mask=mask)
        if PDL:
            gdc_wait()
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
            tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        tl.store(out_ptr + row * stride_o + offs, (xf * rstd).to(x.dtype) * w, mask=mask)

    @triton.jit
    def _norm_rope_kernel(q_ptr, k_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, positions_ptr,
                          stride_q_token, stride_k_token, eps,
                          # store_token_kv's arguments (triton_attention.store_kv_args), used with STORE_KV
                          key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
                          stride_key_token, stride_key_head, stride_value_token, stride_value_head,
                          stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                          stride_scale_block, stride_scale_slot, stride_scale_head,
                          NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HALF_ROT: tl.constexpr, HEADS_PADDED: tl.constexpr, DIM_PADDED: tl.constexpr,
                          HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr,
                          NUM_KV_HEADS: tl.constexpr, KV_HEADS_PADDED: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                          MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # (worker/pdl.py) positions are a step input: read before waiting
            gdc_launch_dependents()
        token = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions_ptr + token).to(tl.int64)
        if PDL:
            gdc_wait()
        heads = tl.arange(0, HEADS_PADDED)
        dims = tl.arange(0, DIM_PADDED)
        dim_valid = dims < HEAD_DIM
        for which in tl.static_range(2):
            if which == 0:
                base = q_ptr + token * stride_q_token
                num_heads = NUM_Q_HEADS
                norm_ptr = q_norm_ptr
            else:
                base = k_ptr + token * stride_k_token
                num_heads = NUM_K_HEADS
                norm_ptr = k_norm_ptr
            head_valid = heads < num_heads
            rotated = normed_rotated_heads(base, heads, HEAD_DIM, head_valid, dims, dim_valid, norm_ptr, cos_ptr,
                                           sin_ptr, pos, eps, HEAD_DIM, HALF_ROT, HAS_NORM)
            # In place: every thread's loads (a dim's rotation partner may be another warp's) land
            # before any thread stores.
            tl.debug_barrier()
            tl.store(base + heads[:, None] * HEAD_DIM + dims[None, :], rotated,
                     mask=head_valid[:, None] & dim_valid[None, :])
        if STORE_KV:
            tl.debug_barrier()  # the store reads the rotated k just written
            store_token_kv(
                key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr, token,
                stride_key_token, stride_key_head, stride_value_token, stride_value_head,
                stride_cache_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                stride_scale_block, stride_scale_slot, stride_scale_head,
                NUM_KV_HEADS, KV_HEADS_PADDED, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_SIZE, FP8, FP8_MAX, MIN_SCALE)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < N
        if PDL:  # (as in _add_rms_norm_kernel)
            gdc_launch_dependents()
            gdc_wait()
        gate = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + N + col, mask=mask, other=0.0)
        silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        tl.store(out_ptr + row * stride_o + col, silu * up, mask=mask)


# ---------------------------------------------------------------- the ops


def _before_projection(x: torch.Tensor) -> dict:
    """Launch options for a kernel whose output a projection reads next: PDL where the step's rows
    are the Hopper kernel's (hopper_gemm.starts_early), so that it loads its weights while this
    one finishes. Where cuBLAS takes the projection after all (a shape the kernel does not serve),
    cuBLAS simply starts after this kernel, as without PDL."""
    return pdl.launch_options(x.device) if hopper_gemm.starts_early(x) else pdl.OFF


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (RMSNorm(x + residual) * weight, x + residual); without a residual, (norm(x), x).
    On CUDA the sum is written into `residual` in place."""
    if not _use_triton(x):
        if residual is not None:
            x = x + residual
        return rms_norm_cpu(x, weight, eps), x
    n = x.shape[-1]
    out = torch.empty_like(x)
    _add_rms_norm_kernel[(x.shape[0],)](
        x, residual if residual is not None else x, out, weight, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None, num_warps=4 if n <= 2048 else 8,
        **_before_projection(x),
    )
    return out, (residual if residual is not None else x)


def norm_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
    kv_store: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim]: optional per-head RMSNorm,
    then RoPE with cos/sin_cache [max_position, rotary_dim // 2] (fp32). In place on CUDA (q and k
    may be views into one qkv tensor, whose v part is left alone).

    kv_store (CUDA only): (value, kv_cache, slot_mapping, layout); the kernel then also writes each
    token's rotated k and its v into the cache, as triton_attention.store_kv would."""
    if not _use_triton(q):
        if kv_store is not None:
            raise ValueError("norm_rope stores K/V only on CUDA")
        if q_norm is not None:
            q, k = rms_norm_cpu(q, q_norm, eps), rms_norm_cpu(k, k_norm, eps)
        cos, sin = cos_cache[positions], sin_cache[positions]
        return rope_cpu(q, cos, sin), rope_cpu(k, cos, sin)
    num_tokens, num_q_heads, head_dim = q.shape
    # The kernel steps over tokens by stride and expects each token's heads packed: views of the
    # fused qkv output are, so they are rotated where they lie (copying them cost two kernels a layer).
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    if k.stride(2) != 1 or k.stride(1) != head_dim:
        k = k.contiguous()
    half_rot = cos_cache.shape[-1]
    if kv_store is not None:
        value, kv_cache, slot_mapping, layout = kv_store
        store_args, store_constants = store_kv_args(k, value, kv_cache, slot_mapping, layout)
    else:  # unused stand-ins, as many as store_kv_args gives: 7 tensors and the strides
        store_args = (q,) * 7 + (0,) * STORE_KV_STRIDES
        store_constants = dict(NUM_KV_HEADS=1, KV_HEADS_PADDED=1, HEAD_DIM=head_dim, HEAD_DIM_PADDED=1, BLOCK_SIZE=1,
                               FP8=False, FP8_MAX=1.0, MIN_SCALE=1.0)
    _norm_rope_kernel[(num_tokens,)](
        q, k, q_norm if q_norm is not None else q, k_norm if k_norm is not None else k,
        cos_cache, sin_cache, positions, q.stride(0), k.stride(0), eps, *store_args,
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=k.shape[1], HALF_ROT=half_rot,
        HEADS_PADDED=triton.next_power_of_2(num_q_heads), DIM_PADDED=triton.next_power_of_2(head_dim),
        HAS_NORM=q_norm is not None, STORE_KV=kv_store is not None,
        **store_constants, num_warps=4, **pdl.launch_options(q.device),
    )
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * n] = gate | up -> silu(gate) * up [tokens, n]."""
    n = x.shape[-1] // 2
    if not _use_triton(x):
        gate, up = x.split(n, dim=-1)
        return F.silu(gate).mul_(up)  # (in place on silu's fresh output: one buffer fewer)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), N=n, BLOCK=block,
                                                               **_before_projection(x))
    return out
