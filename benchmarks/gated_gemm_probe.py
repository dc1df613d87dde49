"""Probe: a prompt step's gate|up projection with SiLU-and-mul in a Triton GEMM's epilogue, against
cuBLAS then ops.silu_and_mul (what the engine runs for steps over 256 rows).

    python3 benchmarks/gated_gemm_probe.py [--rows 16384 8192 2048]    # on the device machine (Hopper)
    python3 benchmarks/gated_gemm_probe.py --engine --rows 512 1024 2693 16384   # worker/prompt_gemm.py's kernel

A prompt step of 16,384 tokens spends ~105 us a layer in SiLU-and-mul (bf16, H100): it reads gate|up's
[tokens, 6,144] output back and writes half of it. A GEMM that returns silu(gate) * up from its sums
would save that kernel and half of the projection's writes, if its main loop kept up with cuBLAS's.
This measures whether a Triton kernel does (TMA descriptors, persistent tiles; each program holds a
gate tile and the same features' up tile, from the same x chunks), and also times the plain products
of Qwen3-0.6B's four projections in the same kernel against cuBLAS. us a call, in CUDA graphs of 8
calls; bits: the share of outputs bit-equal to the engine's path.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for benchmarks.graph_timing

from benchmarks.graph_timing import graph_time_us
from minivllm.worker import ops, prompt_gemm

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


@triton.jit
def _gemm_kernel(x_desc, w_desc, out_desc, M, N_OUT, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 NUM_SMS: tl.constexpr, GATED: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr):
    """out = x W^T [M, N_OUT]; GATED: W is gate rows then up rows (2 N_OUT of them) and
    out = silu(x Wg^T) * (x Wu^T), rounded as the engine's path rounds (each product to bf16 first)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N_OUT, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    in_group = GROUP_M * num_pid_n
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        first_m = (tile // in_group) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        off_m = (first_m + tile % group_rows) * BLOCK_M
        off_n = ((tile % in_group) // group_rows) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([off_m, ki * BLOCK_K])
            acc = tl.dot(a, w_desc.load([off_n, ki * BLOCK_K]).T, acc)
            if GATED:
                acc_up = tl.dot(a, w_desc.load([N_OUT + off_n, ki * BLOCK_K]).T, acc_up)
        if GATED:
            gate = acc.to(tl.bfloat16).to(tl.float32)
            y = (gate / (1.0 + tl.exp(-gate))).to(tl.bfloat16) * acc_up.to(tl.bfloat16)
        else:
            y = acc.to(tl.bfloat16)
        out_desc.store([off_m, off_n], y)


def triton_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: tuple, gated: bool) -> torch.Tensor:
    block_m, block_n, block_k, stages, warps, flatten, ws = config
    m, k = x.shape
    n_out = out.shape[1]
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n_out, block_n)
    _gemm_kernel[(min(num_sms, tiles),)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(w, [block_n, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, block_n]), m, n_out, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, NUM_SMS=num_sms, GATED=gated,
        FLATTEN=flatten, WS=ws, num_stages=stages, num_warps=warps)
    return out


GATED_CONFIGS = [c + (f, ws) for c in [(128, 128, 64, 3, 8), (128, 64, 64, 4, 8), (128, 64, 64, 4, 4),
                                        (64, 128, 64, 4, 4), (128, 128, 64, 2, 8)]
                 for f, ws in [(False, False), (True, False), (True, True)]]
PLAIN_CONFIGS = [c + (f, ws) for c in [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4)]
                 for f, ws in [(False, False), (True, False), (True, True)]]


def try_time(fn) -> float | None:
    try:
        return graph_time_us(lambda: [fn() for _ in range(8)]) / 8
    except Exception as exc:  # a config Triton cannot build here (shared memory, warp specialization)
        print(f"      ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})")
        return None


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.view(torch.int16) == b.view(torch.int16)).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16384, 8192, 2048])
    parser.add_argument("--engine", action="store_true",
                        help="time only the engine's kernel (prompt_gemm.silu_mul_linear) against cuBLAS + silu_and_mul")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for name, (n, k) in SHAPES.items()}
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}: us a call")
    if args.engine:
        w = weights["gate_up"]
        for rows in args.rows:
            x = torch.randn(rows, w.shape[1], device=dev, dtype=torch.bfloat16)
            proj = torch.empty(rows, w.shape[0], device=dev, dtype=torch.bfloat16)
            t_two = graph_time_us(lambda: [ops.silu_and_mul(torch.mm(x, w.T, out=proj)) for _ in range(8)]) / 8
            t_one = graph_time_us(lambda: [prompt_gemm.silu_mul_linear(x, w) for _ in range(8)]) / 8
            same = bits_equal(prompt_gemm.silu_mul_linear(x, w), ops.silu_and_mul(F.linear(x, w)))
            print(f"rows {rows:5d}: cuBLAS + silu_and_mul {t_two:7.1f}, prompt_gemm {t_one:7.1f} ({t_one / t_two:.3f}x) "
                  f"bits {same:.4f}")
        return
    for rows in args.rows:
        n, k = SHAPES["gate_up"]
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        w = weights["gate_up"]
        proj = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
        ref = ops.silu_and_mul(F.linear(x, w))
        t_mm = graph_time_us(lambda: [torch.mm(x, w.T, out=proj) for _ in range(8)]) / 8
        t_silu = graph_time_us(lambda: [ops.silu_and_mul(proj) for _ in range(8)]) / 8
        flops = 2 * rows * n * k
        print(f"rows {rows}: gate_up cuBLAS {t_mm:7.1f} ({flops / t_mm / 1e6:4.0f} TFLOP/s) + silu_and_mul "
              f"{t_silu:6.1f} = {t_mm + t_silu:7.1f}")
        out = torch.empty(rows, n // 2, device=dev, dtype=torch.bfloat16)
        for config in GATED_CONFIGS:
            t = try_time(lambda: triton_gemm(x, w, out, config, True))
            if t is not None:
                triton_gemm(x, w, out, config, True)
                err = (out.float() - ref.float()).abs().max().item()
                print(f"  gated {config}: {t:7.1f} ({flops / t / 1e6:4.0f} TFLOP/s) bits {bits_equal(out, ref):.3f} "
                      f"max|diff| {err:.3g}")
        for name, (n, k) in SHAPES.items():
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            w = weights[name]
            out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            t_mm = graph_time_us(lambda: [torch.mm(x, w.T, out=out) for _ in range(8)]) / 8
            ref = out.clone()
            flops = 2 * rows * n * k
            line = [f"  {name}: cuBLAS {t_mm:6.1f} ({flops / t_mm / 1e6:4.0f})"]
            for config in PLAIN_CONFIGS:
                t = try_time(lambda: triton_gemm(x, w, out, config, False))
                if t is not None:
                    triton_gemm(x, w, out, config, False)
                    line.append(f"{config[:2]}{'f' if config[5] else ''}{'w' if config[6] else ''} {t:6.1f} "
                                f"bits {bits_equal(out, ref):.2f}")
            print(", ".join(line))


if __name__ == "__main__":
    main()
