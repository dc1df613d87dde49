"""Check and time worker/small_batch_gemm.py against cuBLAS (F.linear) on Qwen3-0.6B's projections.

    python3 benchmarks/small_batch_gemm.py [--chain]    # on the device machine
Prints, per shape and row count: relative error vs an fp64 reference, and the time of each with the
bandwidth it reaches (weight bytes / time); then, at one row, each fused prologue (add + RMSNorm
before qkv and gate|up, SiLU-and-mul before down) against its two kernels run one after the other.
With --chain: a whole step's projections at one row, per tiling, with and without PDL (`chain`).
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for benchmarks.graph_timing

from benchmarks.graph_timing import graph_time_us
from minivllm.worker import ops, small_batch_gemm

# (N, K) of Qwen3-0.6B: qkv, o, gate|up, down, LM head
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]


def rotating_time_us(fn, weights: list[torch.Tensor], calls: int = 24) -> float:
    """Per call of fn(w), inside a CUDA graph of `calls` back-to-back calls (as a decode step runs
    them), rotating over the weights so L2 does not serve the reads."""
    rotation = itertools.cycle(weights)
    return graph_time_us(lambda: fn(next(rotation)), calls=calls)


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
            cublas = rotating_time_us(lambda w: F.linear(x, w), weights)
            gemv = rotating_time_us(lambda w: small_batch_gemm.linear(x, w), weights)
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
            two = rotating_time_us(lambda w: small_batch_gemm.linear(ops.silu_and_mul(gate_up), w), weights)
            one = rotating_time_us(lambda w: small_batch_gemm.silu_mul_linear(gate_up, w), weights)
        else:
            x, residual = torch.randn(1, k, device="cuda", dtype=torch.bfloat16), torch.randn(1, k, device="cuda",
                                                                                             dtype=torch.bfloat16)
            g = torch.randn(k, device="cuda", dtype=torch.bfloat16)
            two = rotating_time_us(lambda w: small_batch_gemm.linear(ops.add_rms_norm(x, g, 1e-6, residual)[0], w), weights)
            one = rotating_time_us(lambda w: small_batch_gemm.norm_linear(x, residual, g, 1e-6, w)[0], weights)
        print(f"{n:>7}x{k:<6} {'silu*mul' if gated else 'add+rmsnorm':>12} {two:15.1f} {one:9.1f}")


def sweep() -> None:
    """One row: the kernel's settings (the tiling without PDL) against cuBLAS, per shape."""
    from minivllm.worker import pdl

    pdl.ENABLED = False
    torch.manual_seed(0)
    x_for = {}
    for min_programs in (256, 512, 1024):
        for per_chunk in (1024, 2048, 4096):
            for warps in (4, 8):
                small_batch_gemm.CHUNK_WEIGHTS = per_chunk
                small_batch_gemm.TILINGS[False] = small_batch_gemm.Tiling(min_programs, False, per_chunk // (32 * warps))
                total = 0.0
                for n, k in SHAPES[:4]:
                    weights = x_for.setdefault((n, k), [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                                                        for _ in range(8)])
                    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
                    total += rotating_time_us(lambda w: small_batch_gemm.linear(x, w), weights)
                print(f"programs>={min_programs} chunk {per_chunk} warps {warps}: one layer's 4 projections "
                      f"{total:.1f} us")
    total = 0.0
    for n, k in SHAPES[:4]:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        total += rotating_time_us(lambda w: F.linear(x, w), x_for[(n, k)])
    print(f"cuBLAS: one layer's 4 projections {total:.1f} us")


def chain(layers: int = 28) -> None:
    """One row through `layers` layers' four projections as a decode step runs them (add+RMSNorm ->
    qkv, o, add+RMSNorm -> gate|up, SiLU-and-mul -> down; every layer its own weights, 880 MB for
    Qwen3-0.6B's 28, so L2 serves none), captured in one CUDA graph: the time per layer for each
    tiling (programs per projection, whole weight rows per program or 1024-wide chunks, weights per
    thread), with and without PDL. Prints the best as
    `BEST <min programs>:<whole rows>:<weights per thread> <PDL>`."""
    from minivllm.worker import pdl

    torch.manual_seed(0)
    hidden, q_kv, inter = 1024, 4096, 3072
    dev, dt = "cuda", torch.bfloat16
    weights = [(torch.randn(q_kv, hidden, device=dev, dtype=dt) / hidden**0.5,
                torch.randn(hidden, 2048, device=dev, dtype=dt) / 2048**0.5,
                torch.randn(2 * inter, hidden, device=dev, dtype=dt) / hidden**0.5,
                torch.randn(hidden, inter, device=dev, dtype=dt) / inter**0.5) for _ in range(layers)]
    norm_weight = torch.ones(hidden, device=dev, dtype=dt)
    x0 = torch.randn(1, hidden, device=dev, dtype=dt)

    def forward() -> torch.Tensor:
        h, residual = x0, None
        for w_qkv, w_o, w_gate_up, w_down in weights:
            qkv, residual = small_batch_gemm.norm_linear(h, residual, norm_weight, 1e-6, w_qkv)
            o = small_batch_gemm.linear(qkv[:, :2048], w_o)  # (attention left out)
            gate_up, residual = small_batch_gemm.norm_linear(o, residual, norm_weight, 1e-6, w_gate_up)
            h = small_batch_gemm.silu_mul_linear(gate_up, w_down)
        return h + residual

    def run_config(tune: tuple[int, int, int], use_pdl: bool) -> tuple[float, torch.Tensor]:
        small_batch_gemm.TILINGS[use_pdl] = small_batch_gemm.Tiling(tune[0], bool(tune[1]), tune[2])
        pdl.ENABLED = use_pdl
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward()
        return triton.testing.do_bench(graph.replay, return_mode="median") * 1e3 / layers, out

    results = {}
    reference = None
    print(f"{'min programs':>12} {'whole rows':>10} {'w/thread':>8} {'PDL':>4} {'us/layer':>9} {'GB/s':>6}")
    for tune in [(1024, 0, 32), (1024, 1, 32), (1024, 1, 16), (512, 1, 32), (512, 1, 16), (512, 0, 32),
                 (256, 1, 32), (256, 1, 64), (2048, 1, 32)]:
        for use_pdl in (False, True):
            t, out = run_config(tune, use_pdl)
            reference = out if reference is None else reference
            err = ((out.double() - reference.double()).norm() / reference.double().norm()).item()
            results[(tune, use_pdl)] = t
            print(f"{tune[0]:>12} {tune[1]:>10} {tune[2]:>8} {int(use_pdl):>4} {t:9.2f} "
                  f"{31.5e6 / t / 1e3:6.0f}  (rel. diff to the first {err:.1e})", flush=True)
    (tune, use_pdl), t = min(results.items(), key=lambda item: item[1])
    print(f"BEST {':'.join(map(str, tune))} {int(use_pdl)}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--chain"]:
        chain()
    else:
        main()
        fused()
        sweep()
