"""Check and time worker/small_batch_gemm.py against cuBLAS (F.linear) on Qwen3-0.6B's projections.

    python3 benchmarks/small_batch_gemm.py     # on the device machine
Prints, per shape and row count: relative error vs an fp64 reference, and the time of each with the
bandwidth it reaches (weight bytes / time); then, at one row, each fused prologue (add + RMSNorm
before qkv and gate|up, SiLU-and-mul before down) against its two kernels run one after the other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton.testing

from minivllm.worker import ops, small_batch_gemm

# (N, K) of Qwen3-0.6B: qkv, o, gate|up, down, LM head
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]


def graph_time_us(fn, weights: list[torch.Tensor], calls: int = 24) -> float:
    """Per call, inside a CUDA graph of `calls` back-to-back calls (as a decode step runs them),
    rotating over the weights so L2 does not serve the reads."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for w in weights:
            fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    return triton.testing.do_bench(graph.replay, return_mode="median") * 1e3 / calls


def main() -> None:
    torch.manual_seed(0)
    print(f"{'N x K':>14} {'rows':>4} {'rel err':>9} {'cuBLAS us':>10} {'GB/s':>6} {'gemv us':>8} {'GB/s':>6}")
    for n, k in SHAPES:
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(2 if n > 100_000 else 8)]
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for m in (1, 2, 3, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.double(), weights[0].double(), bias.double())
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            out = small_batch_gemm.linear(x, weights[0], bias)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2 and not out.isnan().any(), (n, k, m, err)
            cublas = graph_time_us(lambda w: F.linear(x, w), weights)
            gemv = graph_time_us(lambda w: small_batch_gemm.linear(x, w), weights)
            nbytes = n * k * 2
            print(f"{n:>7}x{k:<6} {m:>4} {err:9.1e} {cublas:10.1f} {nbytes / cublas / 1e3:6.0f} {gemv:8.1f} "
                  f"{nbytes / gemv / 1e3:6.0f}")


def fused() -> None:
    """One row: a norm or SiLU-and-mul kernel followed by the projection, against the one kernel
    that does both (in CUDA graphs, as a decode step runs them)."""
    torch.manual_seed(0)
    print(f"{'N x K':>14} {'prologue':>12} {'two kernels us':>15} {'fused us':>9}")
    for (n, k), gated in (((4096, 1024), False), ((6144, 1024), False), ((1024, 3072), True)):
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(8)]
        if gated:
            gate_up = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
            two = graph_time_us(lambda w: small_batch_gemm.linear(ops.silu_and_mul(gate_up), w), weights)
            one = graph_time_us(lambda w: small_batch_gemm.silu_mul_linear(gate_up, w), weights)
        else:
            x, residual = torch.randn(1, k, device="cuda", dtype=torch.bfloat16), torch.randn(1, k, device="cuda",
                                                                                             dtype=torch.bfloat16)
            g = torch.randn(k, device="cuda", dtype=torch.bfloat16)
            two = graph_time_us(lambda w: small_batch_gemm.linear(ops.add_rms_norm(x, g, 1e-6, residual)[0], w), weights)
            one = graph_time_us(lambda w: small_batch_gemm.norm_linear(x, residual, g, 1e-6, w)[0], weights)
        print(f"{n:>7}x{k:<6} {'silu*mul' if gated else 'add+rmsnorm':>12} {two:15.1f} {one:9.1f}")


def sweep() -> None:
    """One row: the kernel's settings against cuBLAS, per shape."""
    torch.manual_seed(0)
    x_for = {}
    for min_programs in (256, 512, 1024):
        for per_chunk in (1024, 2048, 4096):
            for warps in (4, 8):
                small_batch_gemm._MIN_PROGRAMS, small_batch_gemm._WEIGHTS_PER_CHUNK = min_programs, per_chunk
                small_batch_gemm._NUM_WARPS = warps
                total = 0.0
                for n, k in SHAPES[:4]:
                    weights = x_for.setdefault((n, k), [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                                                        for _ in range(8)])
                    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
                    total += graph_time_us(lambda w: small_batch_gemm.linear(x, w), weights)
                print(f"programs>={min_programs} chunk {per_chunk} warps {warps}: one layer's 4 projections "
                      f"{total:.1f} us")
    total = 0.0
    for n, k in SHAPES[:4]:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        total += graph_time_us(lambda w: F.linear(x, w), x_for[(n, k)])
    print(f"cuBLAS: one layer's 4 projections {total:.1f} us")


if __name__ == "__main__":
    main()
    fused()
    sweep()
