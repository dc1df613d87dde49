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
bfloat16, then the product of the two). On the H100 the probe found every output bit-equal to cuBLAS
then silu_and_mul at these shapes; the tests allow a bfloat16 step on 1% of them. Decode steps (at
most hopper_gemm.MAX_ROWS rows) keep the Hopper GEMM's own SiLU-and-mul epilogue (worker/hopper_gemm.py).

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

ENABLED = os.environ.get("MINIVLLM_PROMPT_GEMM", "1") != "0"
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
