"""y = x W^T for a handful of rows (batch-1 / small-batch decode), as one bandwidth-bound Triton kernel.

At a few rows a projection is a matrix-vector product: its time is reading W once. cuBLAS picks
tensor-core tiles for it (at 1 row, 64x8 tiles plus a split-K reduction kernel) that read a
Qwen3-0.6B step's 1.2 GB of weights at ~1.3 TB/s on an H100, under half the card's bandwidth.
Here each program owns BLOCK_N output columns, streams their rows of W in BLOCK_K-wide chunks
(consecutive addresses across the threads, 16-byte loads), multiplies them with the few rows of
x on the CUDA cores and accumulates in fp32. BLOCK_N is chosen per shape so the grid holds
enough programs to keep every multiprocessor's memory pipe busy; with PDL (worker/pdl.py) fewer,
wider programs that load all their weights before waiting on the kernel before (TILINGS).

The kernel can also compute its input on the way in, so that the small element-wise kernel which
would otherwise run before it (a launch and a few microseconds each, in a step of ~300 kernels)
goes away:
  silu_mul_linear  the input is silu(gate) * up of a fused gate|up output (the MLP's down proj);
  norm_linear      the input is RMSNorm(x + residual) * norm_weight (the projections after a
                   pre-norm). y = W (s * g) * rstd: rstd = 1 / rms(s) is one number per row, so it
                   is applied to the finished sums, and the sum of squares is taken in the same
                   pass over s that feeds the products. Program 0 writes s = x + residual out (the
                   residual stream); every program adds it up for itself.

Used by the linear layers on CUDA for at most MAX_ROWS rows (worker/models/parallel_layers.py);
everything bigger stays on cuBLAS, which is compute-efficient there.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from minivllm.worker import pdl

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only torch builds
    triton = None

ENABLED = os.environ.get("MINIVLLM_SMALL_BATCH_GEMM", "1") != "0"  # "0": cuBLAS for every row count
MAX_ROWS = 1  # from 2 rows on, cuBLAS's tensor-core tiles are as fast (benchmarks/small_batch_gemm.py)


class Tiling(NamedTuple):
    """How a projection is cut into programs (see _tiles)."""

    min_programs: int  # the column block narrows (down to one column) until the grid has this many
    whole_rows: bool  # a program loads all its weights at once if they fit MAX_TILE, else CHUNK_WEIGHTS a time
    weights_per_thread: int  # (sets num_warps)


MAX_TILE = 16384
CHUNK_WEIGHTS = 4096
# benchmarks/small_batch_gemm.py --chain, one row through Qwen3-0.6B's 28 layers of projections on
# an H100: 23.1 us a layer with the plain tiling, 18.0 with the PDL one and PDL on (24.4 with it off).
# Without PDL, ~8 programs per multiprocessor (132) keep enough loads in flight within one kernel,
# and they fill the register file. With PDL a kernel's programs start while the kernel before still
# runs and load their weights before they wait for it: that needs room beside it, so ~2 wide programs
# per multiprocessor, each loading all its weight rows up front.
TILINGS = {False: Tiling(1024, False, 32), True: Tiling(256, True, 64)}  # keyed by PDL on


def supports(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether x [M, K] (or, for silu_mul_linear, [M, 2K]) fits the kernel with this weight [N, K]."""
    return (ENABLED and triton is not None and weight is not None and x.is_cuda and x.dim() == 2
            and x.shape[0] <= MAX_ROWS and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and x.stride(1) == 1 and weight.is_contiguous() and weight.shape[1] % 8 == 0)


# What the kernel does to its input before the product (see the module docstring).
PLAIN, SILU_MUL, RMS_NORM, ADD_RMS_NORM = 0, 1, 2, 3

if triton is not None:

    @triton.jit
    def _load_weights(w_rows, k0, ks, col_mask, K):
        """One BLOCK_K-wide chunk of the program's weight rows; read once: evict_first keeps L2 for
        activations."""
        k = k0 + ks
        return tl.load(w_rows + k[None, :], mask=col_mask[:, None] & (k < K)[None, :], other=0.0,
                       eviction_policy="evict_first")

    @triton.jit
    def _gemv_chunk(acc, sum_squares, w, k0, x_ptr, residual_ptr, summed_ptr, norm_weight_ptr, rows, row_mask, ks,
                    K, stride_x, stride_residual, PROLOGUE: tl.constexpr):
        """Add one BLOCK_K-wide chunk of weights (w, already loaded) times the same chunk of x."""
        k = k0 + ks
        k_mask = k < K
        x_mask = row_mask[:, None] & k_mask[None, :]
        x_offs = rows[:, None] * stride_x + k[None, :]
        if PROLOGUE == 1:  # SILU_MUL: x is gate | up, K wide each; rounded as ops.silu_and_mul does
            gate = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + x_offs + K, mask=x_mask, other=0.0)
            xv = (gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up
        else:
            xv = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
        if PROLOGUE == 3:  # ADD_RMS_NORM: s = x + residual, in the stream's dtype
            xv = xv + tl.load(residual_ptr + rows[:, None] * stride_residual + k[None, :], mask=x_mask, other=0.0)
            tl.store(summed_ptr + rows[:, None] * K + k[None, :], xv, mask=x_mask & (tl.program_id(0) == 0))
        xv = xv.to(tl.float32)
        if PROLOGUE >= 2:  # RMS_NORM / ADD_RMS_NORM: s * g now, / rms(s) at the end
            sum_squares += tl.sum(xv * xv, axis=1)
            xv = xv * tl.load(norm_weight_ptr + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        acc += tl.sum(w.to(tl.float32)[None, :, :] * xv[:, None, :], axis=2)
        return acc, sum_squares

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, residual_ptr, summed_ptr, norm_weight_ptr,
                     M, N, K, stride_x, stride_residual, stride_out, eps,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PROLOGUE: tl.constexpr, PDL: tl.constexpr):
        """Columns [pid * BLOCK_N, +BLOCK_N) of all M (<= ROWS) rows: each weight is read once.

        PDL (worker/pdl.py): the weights are no kernel's output, so the first chunk of them is
        loaded before waiting for the kernel before; x, the residual and every store come after."""
        if PDL:
            gdc_launch_dependents()  # the next kernel may start loading its weights too
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        rows = tl.arange(0, ROWS)
        row_mask = rows < M
        ks = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        sum_squares = tl.zeros((ROWS,), dtype=tl.float32)
        w = _load_weights(w_rows, 0, ks, col_mask, K)
        if PDL:
            gdc_wait()
        acc, sum_squares = _gemv_chunk(acc, sum_squares, w, 0, x_ptr, residual_ptr, summed_ptr, norm_weight_ptr,
                                       rows, row_mask, ks, K, stride_x, stride_residual, PROLOGUE)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w = _load_weights(w_rows, k0, ks, col_mask, K)
            acc, sum_squares = _gemv_chunk(acc, sum_squares, w, k0, x_ptr, residual_ptr, summed_ptr,
                                           norm_weight_ptr, rows, row_mask, ks, K, stride_x, stride_residual,
                                           PROLOGUE)
        if PROLOGUE >= 2:
            acc = acc * tl.rsqrt(sum_squares / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])


def _tiles(n: int, k: int, tiling: Tiling) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [n, k] weight: the widest power-of-two column block (<= 16)
    that still gives tiling.min_programs programs, its whole rows or 1024-wide chunks of them."""
    block_n = 16
    while block_n > 1 and triton.cdiv(n, block_n) < tiling.min_programs:
        block_n //= 2
    row = triton.next_power_of_2(k)
    if tiling.whole_rows and block_n * row <= MAX_TILE:
        block_k = row
    else:
        block_k = max(64, min(1024, CHUNK_WEIGHTS // block_n))
    num_warps = min(16, max(4, block_n * block_k // (32 * tiling.weights_per_thread)))
    return block_n, block_k, num_warps


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: int,
            residual: torch.Tensor | None = None, summed: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    launch_options = pdl.launch_options(x.device)
    block_n, block_k, num_warps = _tiles(n, k, TILINGS[launch_options["PDL"]])
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out,
        residual if residual is not None else x, summed if summed is not None else x,
        norm_weight if norm_weight is not None else weight,
        m, n, k, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        ROWS=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        PROLOGUE=prologue, num_warps=num_warps, **launch_options,
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] @ weight [N, K]^T (+ bias) -> [M, N]; see `supports`."""
    return _launch(x, weight, bias, PLAIN)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(silu(gate) * up) @ weight^T (+ bias) for gate_up [M, 2K] = gate | up; `supports(gate_up,
    weight)` must hold."""
    if gate_up.shape[1] != 2 * weight.shape[1]:
        raise ValueError(f"gate_up has {gate_up.shape[1]} columns, expected 2 x {weight.shape[1]}")
    return _launch(gate_up, weight, bias, SILU_MUL)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s) * norm_weight) @ weight^T (+ bias) with s = x + residual (x without one); returns
    it and s, the residual stream after the add (a new tensor; x itself without a residual)."""
    if residual is None:
        return _launch(x, weight, bias, RMS_NORM, norm_weight=norm_weight, eps=eps), x
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # packed rows: the kernel writes row r at r * K
    out = _launch(x, weight, bias, ADD_RMS_NORM, residual=residual, summed=summed, norm_weight=norm_weight, eps=eps)
    return out, summed
