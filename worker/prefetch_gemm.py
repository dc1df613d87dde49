"""y = x W^T for a few dozen rows (a short prompt's step, mid-size decode batches) on the tensor
cores, with the weights fetched into L2 while the kernel before still runs. Opt-in:
MINIVLLM_PREFETCH_GEMM=1 (Hopper, PDL on).

At 64 rows a Qwen3-0.6B layer's four projections are ~30 MB of weights and ~2 GFLOP: ~10 us of
bandwidth, against ~28 us that cuBLAS takes for them inside a CUDA graph on an H100 (6-8 us each).
Its kernels start cold one after the other, each reading its weights from HBM only once it runs.

This kernel is launched with PDL (worker/pdl.py). Its programs start while the kernel before
runs, issue an L2 prefetch for every cache line of their weight rows (`prefetch.global.L2`: no
registers held, nothing waited on), and only then wait for that kernel; the matmul loop after it
reads weights from L2. That needs the kernel before to start its dependents early too, so where
this kernel takes a step's projections, the norms, SiLU-and-mul and the attention kernels between
them launch with PDL as well (`starts_early`). With PDL off it would be a plain Triton GEMM, no
faster than cuBLAS, so it runs only with PDL.

Measured (benchmarks/prefetch_gemm.py, H100, 28 layers of norms and projections in one graph, us
per layer): 64 rows 28.5 against cuBLAS's 33.1; 128 rows 35.9 against 34.6; 4 and 16 rows 53-55
against 31-32 (a 16-row tensor-core tile is mostly padding there, and cuBLAS's kernels for few rows
read the weights faster). So it takes MIN_ROWS..MAX_ROWS only. Tiles: `_tile`, the
widest column block that still gives about one program per multiprocessor; in the same chain
the benchmark's per-projection best tiles did worse than this rule.
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

ENABLED = os.environ.get("MINIVLLM_PREFETCH_GEMM", "0") == "1"  # off until measured end to end (RESULTS.md)
MIN_ROWS, MAX_ROWS = 33, 64  # the rows it takes: where it beat cuBLAS (above)
LINE_ELEMENTS = 64  # a 128-byte L2 line of 16-bit weights
PREFETCH_LINES = 16  # per weight row per prefetch round (BLOCK_N x 16 addresses: a few per thread)


class Tile(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _tile(m: int, n: int, k: int, num_sms: int) -> Tile:
    """A tile for [m, k] x [n, k]^T: rows in one or more 64-row blocks, and the widest column block
    that still gives about one program per multiprocessor."""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    m_tiles = triton.cdiv(m, block_m)
    block_n = 128
    while block_n > 16 and triton.cdiv(n, block_n) * m_tiles < num_sms:
        block_n //= 2
    block_k = 128 if k % 128 == 0 else 64
    return Tile(block_m, block_n, block_k, 4, 4)


def tile_for(m: int, n: int, k: int, device: torch.device) -> Tile:
    """By the row count's power-of-two bucket, so that a step run eagerly and the CUDA graph that
    pads it to a bucket take the same tile (the same bits)."""
    return _tile(max(16, triton.next_power_of_2(m)), n, k, pdl.num_sms(device.index or 0))


def starts_early(rows: int, device: torch.device) -> bool:
    """Whether a step of this many rows runs its projections here, so that they start before the
    kernel ahead of them ends. The kernels between the projections (norms, SiLU-and-mul, attention)
    launch with PDL only then: ahead of cuBLAS it gains nothing (the chain above, 0.2-2% slower)."""
    return ENABLED and triton is not None and MIN_ROWS <= rows <= MAX_ROWS and pdl.enabled(device)


def supports(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether x [M, K] @ weight [N, K]^T goes to this kernel: MIN_ROWS..MAX_ROWS rows, 16-bit, PDL on."""
    return (weight is not None and x.is_cuda and x.dim() == 2 and starts_early(x.shape[0], x.device)
            and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and x.stride(1) == 1 and weight.is_contiguous() and weight.shape[1] % 64 == 0)


if triton is not None:

    @triton.jit
    def _prefetch_l2(ptrs):
        """prefetch.global.L2 at every address of `ptrs` (a hint: it holds no register and nothing
        waits for it). The asm has a side effect, so the compiler keeps it; its output is unused."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _prefetch_gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, stride_x, stride_out,
                              K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              LINE_ELEMENTS: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                              HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        """Rows [pid_m * BLOCK_M, +BLOCK_M) x columns [pid_n * BLOCK_N, +BLOCK_N) of the output.
        Before waiting on the kernel ahead (PDL), the first row block's program prefetches the
        column block's whole weight rows into L2; x and every store come after."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        if PDL:
            gdc_launch_dependents()
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w_rows = w_ptr + tl.minimum(cols, N - 1).to(tl.int64) * K  # (clamped: no stray prefetches)
        if PDL:
            if pid_m == 0:  # (the other row blocks read the same weights: from L2 by then)
                for k0 in range(0, K, PREFETCH_LINES * LINE_ELEMENTS):
                    line_starts = k0 + tl.arange(0, PREFETCH_LINES) * LINE_ELEMENTS
                    _prefetch_l2(w_rows[:, None] + tl.minimum(line_starts, K - LINE_ELEMENTS)[None, :])
            gdc_wait()
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
        w_ptrs = w_rows[None, :] + ks[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # (K a multiple of BLOCK_K: no mask along it)
            a = tl.load(x_ptrs + k0, mask=row_mask[:, None], other=0.0)
            b = tl.load(w_ptrs + k0)
            acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tile: Tile | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N]; `supports(x, weight)` must hold (tile: for
    the benchmark's sweep)."""
    m, k = x.shape
    n = weight.shape[0]
    tile = tile or tile_for(m, n, k, x.device)
    if k % tile.block_k:
        raise ValueError(f"K = {k} is not a multiple of BLOCK_K = {tile.block_k}")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _prefetch_gemm_kernel[(triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m))](
        x, weight, bias if bias is not None else weight, out, m, n, x.stride(0), out.stride(0),
        K=k, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        LINE_ELEMENTS=LINE_ELEMENTS, PREFETCH_LINES=PREFETCH_LINES, HAS_BIAS=bias is not None,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl.launch_options(x.device),
    )
    return out
