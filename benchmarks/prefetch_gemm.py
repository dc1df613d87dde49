"""Time worker/prefetch_gemm.py against cuBLAS on Qwen3-0.6B's projections, 2-128 rows (H100).

    python3 benchmarks/prefetch_gemm.py     # on the device machine

1. Sweep: per row count and projection, each tile (rows per block, columns per block, K step)
   timed inside a CUDA graph of 24 back-to-back calls with PDL on, as a step runs them.
2. Chain: `layers` layers of what a short prompt's step runs between attentions (add + RMSNorm,
   qkv, o, add + RMSNorm, gate|up, SiLU-and-mul, down; 880 MB of weights, so L2 holds none of it
   from one layer to the next) in one CUDA graph, per row count: cuBLAS with the element-wise
   kernels without PDL (the default), cuBLAS with them under PDL (only where prefetch_gemm would
   take the rows), and this kernel (its rule's tiles, then the sweep's best per projection).

First run (H100 80GB HBM3, 2026-11-25, results/2026-11-25-h100-prefetch-gemm/; the element-wise
kernels then took PDL at every row count): the chain at 64 rows 28.5 us per layer against
cuBLAS's 33.1; at 128 rows 35.9 against 34.6; at 4 and 16 rows 53-55 against 31-32. The swept
tiles (3 stages) did worse in the chain than the rule's (4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton.testing

from minivllm.worker import ops, pdl, prefetch_gemm

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # (N, K): qkv, o, gate|up, down
ROWS = [4, 16, 64, 128]


def graph_us(fn, calls: int) -> float:
    """fn's time per call (it makes `calls` calls), replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, return_mode="median") * 1e3 / calls


def sweep() -> dict:
    torch.manual_seed(0)
    best = {}
    print(f"{'rows':>4} {'N x K':>11} {'cuBLAS us':>9} {'rule us':>8} {'best us':>8}  "
          "best tile (m, n, k, warps, stages)")
    for m in ROWS:
        bucket = max(16, triton.next_power_of_2(m))
        for n, k in SHAPES:
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(8)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def calls(linear):
                for i in range(24):
                    linear(x, weights[i % 8])

            cublas = graph_us(lambda: calls(F.linear), 24)
            rule = graph_us(lambda: calls(prefetch_gemm.linear), 24)
            times = {}
            for block_m in sorted({min(bucket, 64), 16}):
                for block_n in (16, 32, 64, 128):
                    for block_k in (64, 128):
                        tile = prefetch_gemm.Tile(block_m, block_n, block_k, 4, 3)
                        out = prefetch_gemm.linear(x, weights[0], tile=tile)
                        err = ((out.double() - F.linear(x.double(), weights[0].double())).norm()
                               / F.linear(x.double(), weights[0].double()).norm()).item()
                        assert err < 5e-3, (m, n, k, tile, err)
                        times[tile] = graph_us(lambda: calls(lambda a, w: prefetch_gemm.linear(a, w, tile=tile)), 24)
            tile, t = min(times.items(), key=lambda item: item[1])
            best[(bucket, n, k)] = min(best.get((bucket, n, k), (tile, t)), (tile, t), key=lambda item: item[1])
            print(f"{m:>4} {n:>5}x{k:<5} {cublas:9.2f} {rule:8.2f} {t:8.2f}  {tuple(tile)}", flush=True)
    return {key: tile for key, (tile, _) in best.items()}


def chain(tiles: dict, layers: int = 28) -> None:
    torch.manual_seed(0)
    hidden, dt = 1024, torch.bfloat16
    weights = [tuple(torch.randn(n, k, device="cuda", dtype=dt) / k**0.5 for n, k in SHAPES) for _ in range(layers)]
    norm_weight = torch.ones(hidden, device="cuda", dtype=dt)
    print(f"\n{layers} layers, us per layer: {'rows':>4} {'cuBLAS':>7} {'cuBLAS+PDL':>10} {'rule':>6} {'swept':>6}")
    for m in ROWS:
        x0 = torch.randn(m, hidden, device="cuda", dtype=dt)
        residual0 = torch.randn(m, hidden, device="cuda", dtype=dt)

        def forward(linear) -> None:
            h, residual = x0, residual0.clone()
            for w_qkv, w_o, w_gate_up, w_down in weights:
                normed, residual = ops.add_rms_norm(h, norm_weight, 1e-6, residual)
                o = linear(linear(normed, w_qkv)[:, :2048], w_o)  # (attention left out)
                normed, residual = ops.add_rms_norm(o, norm_weight, 1e-6, residual)
                h = linear(ops.silu_and_mul(linear(normed, w_gate_up)), w_down)

        row = []
        bucket = max(16, triton.next_power_of_2(m))

        def swept(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return prefetch_gemm.linear(a, w, tile=tiles[(bucket, *w.shape)])

        for use_pdl, linear in ((False, F.linear), (True, F.linear), (True, prefetch_gemm.linear), (True, swept)):
            pdl.ENABLED = use_pdl
            prefetch_gemm.ENABLED = use_pdl  # (the element-wise kernels take PDL with it, for MIN..MAX_ROWS rows)
            row.append(graph_us(lambda: forward(linear), layers))
        pdl.ENABLED = True
        print(f"{'':>27} {m:>4} {row[0]:7.2f} {row[1]:10.2f} {row[2]:6.2f} {row[3]:6.2f}", flush=True)


if __name__ == "__main__":
    assert pdl.enabled(torch.device("cuda")), "needs a Hopper GPU with PDL on"
    chain(sweep())
