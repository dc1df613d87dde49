"""silu(x Wg^T) * (x Wu^T) for prompt steps on Hopper: the MLP's gate|up projection and SiLU-and-mul
as one Triton kernel.

A prompt step's MLP used to run cuBLAS's gate|up projection, then ops.silu_and_mul, which reads the
[tokens, 2 x intermediate] product back and writes half of it: ~105 us a layer in a 16,384-token step
of Qwen3-0.6B on an H100, beside ~286 us for the product. Here each program holds a gate tile and the
same features' up tile, fed by the same x chunks, and returns silu(gate) * up from its sums, so the
product's full output is never written. TMA descriptors carry the tiles; one program per
multiprocessor walks the output tiles (persistent), in groups of GROUP_M row tiles so that a group's
x rows and weight columns stay in L2. Measured on an H100 (benchmarks/gated_gemm_probe.py,
benchmarks/RESULTS.md, 2026-11-27, twenty-eighth session): 325-355 against 380-391 us at 16,384 rows,
159-185 against 199-234 at 8,192, 46 against 57 at 2,048; end to end, the 256-request workload ran
0.8% faster in bf16 and FP8 alike.

Its result is rounded as the two kernels' was (each product to bfloat16, SiLU in float32 rounded to
bfloat16, then the product of the two), and its sums run in cuBLAS's order here: the probe found
every output bit-equal to cuBLAS then silu_and_mul. Decode steps (at most hopper_gemm.MAX_ROWS rows)
keep the Hopper GEMM's own SiLU-and-mul epilogue (worker/hopper_gemm.py).

It serves bfloat16 products without bias on compute capability 9.0, from MIN_ROWS rows, with TMA's
alignment (K and the intermediate size multiples of 8, rows 16-byte aligned); everything else stays
on cuBLAS then silu_and_mul. $MINIVLLM_PROMPT_GEMM=0 keeps those (for measuring).
"""

from __future__ import annotations

import functools
import os

import torch

from minivllm.worker import pdl

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only torch builds have no Triton
    triton = None

# "0": neither kernel; "silu": the gate|up kernel only (both for measuring).
ENABLED = os.environ.get("MINIVLLM_PROMPT_GEMM", "1") != "0"
ROPE = os.environ.get("MINIVLLM_PROMPT_GEMM", "1") not in ("0", "silu")
# Fewer rows stay on cuBLAS: at 1,024 rows this kernel took 29.1 us against 25.8 (300: 14.9 against
# 11.6; 512: even), from 2,048 it wins (H100, benchmarks/results/2026-11-27-prompt-gemm/).
MIN_ROWS = 2048
# The tile (H100, Qwen3-0.6B's gate|up at 2,048-16,384 rows: the best of 15 tilings at each,
# gated_gemm_probe.py). Two 128 x 128 float32 sums a program; three stages of x, gate and up chunks.
BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, NUM_WARPS, GROUP_M = 128, 128, 64, 3, 8, 8


if triton is not None:

    @triton.jit
    def _silu_mul_linear_kernel(x_desc, w_desc, out_desc, num_rows, intermediate, hidden, num_programs,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                GROUP_M: tl.constexpr):
        """out [num_rows, intermediate] = silu(x Wg^T) * (x Wu^T); w holds the gate rows, then the up rows."""
        row_tiles = tl.cdiv(num_rows, BLOCK_M)
        col_tiles = tl.cdiv(intermediate, BLOCK_N)
        group_tiles = GROUP_M * col_tiles
        for tile in range(tl.program_id(0), row_tiles * col_tiles, num_programs):
            # Row tiles by groups of GROUP_M: the programs working at once share x rows and weight columns.
            first_row_tile = (tile // group_tiles) * GROUP_M
            group_rows = tl.minimum(row_tiles - first_row_tile, GROUP_M)
            row = (first_row_tile + tile % group_rows) * BLOCK_M
            col = ((tile % group_tiles) // group_rows) * BLOCK_N
            gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, hidden, BLOCK_K):
                x = x_desc.load([row, k])
                gate = tl.dot(x, w_desc.load([col, k]).T, gate)
                up = tl.dot(x, w_desc.load([intermediate + col, k]).T, up)
            # Rounded as F.linear then silu_and_mul round: each product to the output's dtype first.
            dtype = out_desc.dtype
            gate = gate.to(dtype).to(tl.float32)
            out_desc.store([row, col], (gate / (1.0 + tl.exp(-gate))).to(dtype) * up.to(dtype))


@functools.cache
def _device_serves(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _tma_ready(t: torch.Tensor) -> bool:
    """A 2-D row-major tensor TMA can describe: unit stride along rows, 16-byte aligned base and rows."""
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def supports_silu_mul(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None) -> bool:
    """Whether silu_mul_linear(x, weight) serves: x [M, K] with M >= MIN_ROWS, weight [2 I, K] (gate
    rows, then up rows) with I a multiple of 8, bfloat16, no bias, on an sm_90 GPU."""
    return (ENABLED and triton is not None and weight is not None and bias is None and x.is_cuda
            and x.dim() == 2 and x.shape[0] >= MIN_ROWS and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and weight.shape[0] % 16 == 0 and _tma_ready(x) and _tma_ready(weight)
            and _device_serves(x.device.index or 0))


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) [M, I] for weight [2 I, K] = gate rows | up rows (supports_silu_mul must hold)."""
    num_rows, hidden = x.shape
    intermediate = weight.shape[0] // 2
    out = torch.empty(num_rows, intermediate, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(num_rows, BLOCK_M) * triton.cdiv(intermediate, BLOCK_N)
    num_programs = min(pdl.num_sms(x.device.index or 0), tiles)
    _silu_mul_linear_kernel[(num_programs,)](
        TensorDescriptor.from_tensor(x, [BLOCK_M, BLOCK_K]), TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K]),
        TensorDescriptor.from_tensor(out, [BLOCK_M, BLOCK_N]), num_rows, intermediate, hidden, num_programs,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
        num_stages=NUM_STAGES, num_warps=NUM_WARPS)
    return out


# ---------------------------------------------------------------- qkv with norm, RoPE and the K/V store

# linear_rope's tile: 128 tokens x one head (128 dims), chunks of 64 along K.
ROPE_BLOCK_M, ROPE_BLOCK_K, ROPE_NUM_STAGES, ROPE_NUM_WARPS = 128, 64, 4, 8
HEAD_DIM = 128
ROPE_MIN_ROWS = 2048


if triton is not None:
    from minivllm.worker.attention import kv_cache
    from minivllm.worker.attention.triton_attention import quantize_rows

    FP8_MAX = tl.constexpr(kv_cache.FP8_MAX)
    MIN_SCALE = tl.constexpr(kv_cache.MIN_SCALE)

    @triton.jit
    def _normed_rotated(y, positions, cos_ptr, sin_ptr, weight, eps, HAS_NORM: tl.constexpr,
                        BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
        """y [BLOCK_M tokens, HEAD_DIM] of one head, RMS-normed (HAS_NORM; weight [HEAD_DIM]) and rotated by
        RoPE at each row's position, with ops.norm_rope's arithmetic (triton_attention.normed_rotated_heads):
        the two halves of the head are each other's rotation partners."""
        if HAS_NORM:
            yf = y.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(yf * yf, axis=1) / HEAD_DIM + eps)
            y = (yf * rstd[:, None]).to(y.dtype) * weight[None, :]
        first, second = tl.split(tl.permute(tl.reshape(y, [BLOCK_M, 2, HEAD_DIM // 2]), [0, 2, 1]))
        angles = positions[:, None] * (HEAD_DIM // 2) + tl.arange(0, HEAD_DIM // 2)[None, :]
        c = tl.load(cos_ptr + angles).to(y.dtype)
        s = tl.load(sin_ptr + angles).to(y.dtype)
        rotated = tl.join(first * c - second * s, second * c + first * s)
        return tl.reshape(tl.permute(rotated, [0, 2, 1]), [BLOCK_M, HEAD_DIM])

    @triton.jit
    def _store_head(y, slots, valid, kv_head, cache_ptr, scale_ptr, stride_block, stride_slot, stride_head,
                    stride_dim, stride_scale_block, stride_scale_slot, stride_scale_head,
                    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, TRANSPOSED: tl.constexpr, HEAD_DIM: tl.constexpr):
        """One KV head's vectors y [tokens, HEAD_DIM] into their cache slots (rows not `valid`: none);
        for an FP8 cache as e4m3 with a scale each (triton_attention.quantize_rows). TRANSPOSED: the
        FP8 cache's values, a head's dims each a row of slots, stored with the lanes along the tokens,
        whose slots in a prompt are consecutive (as triton_attention.store_value_group)."""
        block = slots // BLOCK_SIZE
        offset = slots % BLOCK_SIZE
        base = block * stride_block + offset * stride_slot + kv_head * stride_head
        dims = tl.arange(0, HEAD_DIM)
        if FP8:
            y, scale = quantize_rows(y, FP8_MAX, MIN_SCALE)
            tl.store(scale_ptr + block * stride_scale_block + offset * stride_scale_slot + kv_head * stride_scale_head,
                     scale, mask=valid)
        if TRANSPOSED:
            tl.store(cache_ptr + base[None, :] + dims[:, None] * stride_dim, tl.trans(y).to(cache_ptr.dtype.element_ty),
                     mask=valid[None, :])
        else:
            tl.store(cache_ptr + base[:, None] + dims[None, :] * stride_dim, y.to(cache_ptr.dtype.element_ty),
                     mask=valid[:, None])

    @triton.jit
    def _linear_rope_kernel(
        x_desc, w_desc, out_desc, num_rows, hidden, num_programs,
        positions_ptr, slot_mapping_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, eps,
        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
        stride_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_v_dim,
        stride_scale_block, stride_scale_slot, stride_scale_head,
        NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        """out [num_rows, (q + 2 kv heads) x HEAD_DIM] = x W^T, q and k heads normed and rotated; k
        and v heads also stored into the cache at slot_mapping (-1: a padding row, nowhere)."""
        row_tiles = tl.cdiv(num_rows, BLOCK_M)
        heads = NUM_Q_HEADS + 2 * NUM_KV_HEADS
        group_tiles = GROUP_M * heads
        for tile in range(tl.program_id(0), row_tiles * heads, num_programs):
            first_row_tile = (tile // group_tiles) * GROUP_M
            group_rows = tl.minimum(row_tiles - first_row_tile, GROUP_M)
            row = (first_row_tile + tile % group_rows) * BLOCK_M
            head = (tile % group_tiles) // group_rows
            acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
            for k in range(0, hidden, BLOCK_K):
                acc = tl.dot(x_desc.load([row, k]), w_desc.load([head * HEAD_DIM, k]).T, acc)
            y = acc.to(out_desc.dtype)  # the projection's output, as cuBLAS's is rounded
            rows = row + tl.arange(0, BLOCK_M)
            row_valid = rows < num_rows
            if head < NUM_Q_HEADS + NUM_KV_HEADS:
                positions = tl.load(positions_ptr + rows, mask=row_valid, other=0)
                dims = tl.arange(0, HEAD_DIM)
                if HAS_NORM:
                    is_q = head < NUM_Q_HEADS
                    weight = tl.where(is_q, tl.load(q_norm_ptr + dims), tl.load(k_norm_ptr + dims))
                else:
                    weight = tl.zeros((HEAD_DIM,), dtype=out_desc.dtype)  # unused
                y = _normed_rotated(y, positions, cos_ptr, sin_ptr, weight, eps, HAS_NORM, BLOCK_M, HEAD_DIM)
            out_desc.store([row, head * HEAD_DIM], y)
            if head >= NUM_Q_HEADS:
                slots = tl.load(slot_mapping_ptr + rows, mask=row_valid, other=-1)
                valid = row_valid & (slots >= 0)
                if head < NUM_Q_HEADS + NUM_KV_HEADS:
                    _store_head(y, slots, valid, head - NUM_Q_HEADS, k_cache_ptr, k_scale_ptr, stride_block,
                                stride_k_slot, stride_k_head, 1, stride_scale_block, stride_scale_slot,
                                stride_scale_head, BLOCK_SIZE, FP8, False, HEAD_DIM)
                else:
                    _store_head(y, slots, valid, head - NUM_Q_HEADS - NUM_KV_HEADS, v_cache_ptr, v_scale_ptr,
                                stride_block, stride_v_slot, stride_v_head, stride_v_dim, stride_scale_block,
                                stride_scale_slot, stride_scale_head, BLOCK_SIZE, FP8, FP8, HEAD_DIM)


def supports_rope(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, rope) -> bool:
    """Whether linear_rope serves this qkv projection (rope: hopper_gemm.QkvRope): a prompt step of at
    least ROPE_MIN_ROWS rows, bfloat16 without bias on an sm_90 GPU, heads of 128 dims rotated whole,
    int64 positions and slots, and a bf16 or FP8 cache."""
    layout = rope.layout
    return (ROPE and triton is not None and weight is not None and bias is None and x.is_cuda and x.dim() == 2
            and x.shape[0] >= ROPE_MIN_ROWS and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and weight.shape[0] == (rope.num_q_heads + 2 * rope.num_kv_heads) * HEAD_DIM
            and layout.head_dim == HEAD_DIM and (layout.fp8 or layout.dtype == torch.bfloat16)
            and rope.cos_cache.shape[-1] == HEAD_DIM // 2
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (rope.cos_cache, rope.sin_cache))
            and all(t.dtype == torch.int64 and t.is_contiguous() and t.shape[0] == x.shape[0]
                    for t in (rope.positions, rope.slot_mapping))
            and all(t is None or (t.dtype == torch.bfloat16 and t.is_contiguous() and t.shape[0] == HEAD_DIM)
                    for t in (rope.q_norm, rope.k_norm))
            and _tma_ready(x) and _tma_ready(weight) and _device_serves(x.device.index or 0))


def linear_rope(x: torch.Tensor, weight: torch.Tensor, rope) -> torch.Tensor:
    """qkv [T, N] = x [T, K] @ weight [N, K]^T with q and k as ops.norm_rope leaves them (normed,
    rotated) and this step's k and v written to rope.kv_cache at rope.slot_mapping, as norm_rope's
    kv_store would (supports_rope must hold; rope: hopper_gemm.QkvRope)."""
    from minivllm.worker.attention.triton_attention import cache_strides

    num_rows, hidden = x.shape
    out = torch.empty(num_rows, weight.shape[0], dtype=x.dtype, device=x.device)
    views = rope.layout.split(rope.kv_cache)
    key, value = views.key, views.value
    k_scale, v_scale = (views.key_scale, views.value_scale) if rope.layout.fp8 else (key, value)
    (stride_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_v_dim,
     *scale_strides) = cache_strides(views)
    if key.stride(3) != 1 or (not rope.layout.fp8 and stride_v_dim != 1):
        raise ValueError(f"not kv_cache.py's layout: key strides {key.stride()}, value {value.stride()}")
    tiles = triton.cdiv(num_rows, ROPE_BLOCK_M) * (weight.shape[0] // HEAD_DIM)
    num_programs = min(pdl.num_sms(x.device.index or 0), tiles)
    has_norm = rope.q_norm is not None
    _linear_rope_kernel[(num_programs,)](
        TensorDescriptor.from_tensor(x, [ROPE_BLOCK_M, ROPE_BLOCK_K]),
        TensorDescriptor.from_tensor(weight, [HEAD_DIM, ROPE_BLOCK_K]),
        TensorDescriptor.from_tensor(out, [ROPE_BLOCK_M, HEAD_DIM]), num_rows, hidden, num_programs,
        rope.positions, rope.slot_mapping, rope.cos_cache, rope.sin_cache,
        rope.q_norm if has_norm else rope.cos_cache, rope.k_norm if has_norm else rope.cos_cache, rope.eps,
        key, value, k_scale, v_scale, stride_block, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
        stride_v_dim, *scale_strides,
        NUM_Q_HEADS=rope.num_q_heads, NUM_KV_HEADS=rope.num_kv_heads, HAS_NORM=has_norm,
        BLOCK_SIZE=rope.layout.block_size, FP8=rope.layout.fp8, BLOCK_M=ROPE_BLOCK_M, BLOCK_K=ROPE_BLOCK_K,
        GROUP_M=GROUP_M, HEAD_DIM=HEAD_DIM, num_stages=ROPE_NUM_STAGES, num_warps=ROPE_NUM_WARPS)
    return out
