"""The LM head at decode batch sizes: cuBLAS against worker/hopper_gemm.py's kernel (which the
engine gives only weights up to hopper_gemm.MAX_WEIGHT_BYTES). Qwen3-0.6B's head: [151,936, 1,024]
bf16, 311 MB, ~104 us of reading at 3 TB/s.

    python3 benchmarks/lm_head_probe.py [--rows 1 64 128 256]   # on the device machine (Hopper)

Prints us a call (CUDA graphs, one head; it does not fit L2) and each result's largest difference
from cuBLAS's. Found (H100, 2026-11-28): cuBLAS is faster at 128-256 rows (146.0 against 184.7 us
at 256), hopper_gemm only at 64 (122.6 against 129.1)."""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.graph_timing import graph_time_us
from minivllm.worker import hopper_gemm, pdl


def hopper(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """hopper_gemm.linear without its weight-size gate."""
    num_tokens, k = x.shape
    n = weight.shape[0]
    how = hopper_gemm.tiling(num_tokens, n, k, pdl.num_sms(0))
    error = ctypes.create_string_buffer(512)
    rc = hopper_gemm.library().minivllm_hopper_gemm(
        out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0), num_tokens, n,
        k, how.token_tile, int(how.many_stages), 0, 0, torch.cuda.current_stream().cuda_stream, error, 512)
    if rc != 0:
        raise RuntimeError(error.value.decode())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 128, 256])
    args = parser.parse_args()
    weight = torch.randn(151936, 1024, device="cuda", dtype=torch.bfloat16) * 0.03
    print(f"{torch.cuda.get_device_name()}: LM head us a call", flush=True)
    for rows in args.rows:
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, weight)
        out = torch.empty_like(ref)
        line = f"rows {rows:3d}: cuBLAS {graph_time_us(lambda: F.linear(x, weight)):6.1f}"
        if rows >= 2:
            diff = (hopper(x, weight, out).float() - ref.float()).abs().max().item()
            line += f"  hopper_gemm {graph_time_us(lambda: hopper(x, weight, out)):6.1f} (max diff {diff:.3g})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
