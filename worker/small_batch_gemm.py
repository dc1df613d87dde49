"""y = x W^T for a handful of rows (batch-1 / small-batch decode), as one bandwidth-bound Triton kernel.

At a few rows a projection is a matrix-vector product: its time is reading W once. cuBLAS picks
tensor-core tiles for it (at 1 row, 64x8 tiles plus a split-K reduction kernel) that read a
Qwen3-0.6B step's 1.2 GB of weights at ~1.3 TB/s on an H100, under half the card's bandwidth.
Here each program owns BLOCK_N output columns, streams their rows of W in BLOCK_K-wide chunks
(consecutive addresses across the threads, 16-byte loads), multiplies them with the few rows of
x on the CUDA cores and accumulates in fp32. BLOCK_N is chosen per shape so the grid holds
enough programs to keep every multiprocessor's memory pipe busy.

Used by the linear layers on CUDA for at most MAX_ROWS rows (worker/models/parallel_layers.py);
everything bigger stays on cuBLAS, which is compute-efficient there.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds
    triton = None

ENABLED = os.environ.get("MINIVLLM_SMALL_BATCH_GEMM", "1") != "0"  # "0": cuBLAS for every row count
MAX_ROWS = 1  # from 2 rows on, cuBLAS's tensor-core tiles are as fast (benchmarks/small_batch_gemm.py)
_MIN_PROGRAMS = 1024  # ~8 per multiprocessor on an H100 (132): enough loads in flight
_WEIGHTS_PER_CHUNK = 4096  # weights one program loads per loop step (BLOCK_N x BLOCK_K)
_NUM_WARPS = 4


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (ENABLED and triton is not None and x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS
            and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and x.stride(1) == 1 and weight.is_contiguous() and weight.shape[1] % 8 == 0)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_out,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Columns [pid * BLOCK_N, +BLOCK_N) of all M (<= ROWS) rows: each weight is read once."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        rows = tl.arange(0, ROWS)
        row_mask = rows < M
        ks = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_mask = k < K
            w = tl.load(w_rows + k[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0,
                        eviction_policy="evict_first")  # read once: keep L2 for activations
            xv = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=row_mask[:, None] & k_mask[None, :],
                         other=0.0)
            acc += tl.sum(w.to(tl.float32)[None, :, :] * xv.to(tl.float32)[:, None, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])


def _block_n(n: int) -> int:
    """The widest power-of-two column block (<= 16) that still gives _MIN_PROGRAMS programs."""
    block = 16
    while block > 1 and triton.cdiv(n, block) < _MIN_PROGRAMS:
        block //= 2
    return block


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] @ weight [N, K]^T (+ bias) -> [M, N]; see `supports`."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    block_n = _block_n(n)
    rows = triton.next_power_of_2(m)
    block_k = max(64, min(1024, _WEIGHTS_PER_CHUNK // block_n))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), out.stride(0),
        ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=_NUM_WARPS,
    )
    return out
