"""Check and time worker/hopper_gemm.py on Qwen3-0.6B's four projections and a layer's chain of them.

    python3 benchmarks/hopper_gemm_chain.py [--rows 2 16 64 128 256]    # on the device machine (Hopper)

Per row count it prints each projection's time (us a call: 28 calls in a CUDA graph, rotating over 8
copies of the weights so that L2 does not serve them), gate|up with SiLU-and-mul in its epilogue
(`gu+silu`), and the chain a decoder layer runs without attention (add + RMSNorm, qkv, o, add + RMSNorm,
gate|up, SiLU-and-mul, down; us a layer over 28 layers) with SiLU-and-mul as its own kernel and
fused. A result more than 5e-3 (relative) from an fp32 product is marked BAD.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for benchmarks.graph_timing

from benchmarks.graph_timing import graph_time_us
from minivllm.worker import hopper_gemm, ops

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
LAYERS = 28
WEIGHT_COPIES = 8


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 16, 64, 128, 256])
    args = parser.parse_args()
    if hopper_gemm.library() is None:
        raise SystemExit("the Hopper GEMM did not build (see the log)")
    dev = torch.device("cuda")
    layers = [{name: torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for name, (n, k) in SHAPES.items()}
              for _ in range(LAYERS)]
    norm_weight = torch.ones(1024, device=dev, dtype=torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}: us a call; chain us a layer")
    for rows in args.rows:
        line = [f"rows {rows:3d}"]
        for name, (n, k) in SHAPES.items():
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            ref = x.double() @ layers[0][name].double().T
            bad = relative_error(hopper_gemm.linear(x, layers[0][name]), ref) > 5e-3
            out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            us = graph_time_us(lambda: [hopper_gemm.linear(x, layers[i % WEIGHT_COPIES][name], out=out)
                                        for i in range(LAYERS)]) / LAYERS
            line.append(f"{name} {us:5.2f}{' BAD' if bad else ''}")
            if name == "gate_up":
                gate, up = ref.split(n // 2, dim=-1)
                silu_ref = torch.nn.functional.silu(gate) * up
                bad = relative_error(hopper_gemm.linear(x, layers[0][name], silu_mul=True), silu_ref) > 5e-3
                activated = torch.empty(rows, n // 2, device=dev, dtype=torch.bfloat16)
                us = graph_time_us(lambda: [hopper_gemm.linear(x, layers[i % WEIGHT_COPIES][name], out=activated,
                                                               silu_mul=True) for i in range(LAYERS)]) / LAYERS
                line.append(f"gu+silu {us:5.2f}{' BAD' if bad else ''}")
        hidden0 = torch.randn(rows, 1024, device=dev, dtype=torch.bfloat16)
        residual0 = torch.randn(rows, 1024, device=dev, dtype=torch.bfloat16)

        def chain(fused: bool) -> torch.Tensor:
            hidden, residual = hidden0, residual0.clone()
            for weights in layers:
                normed, residual = ops.add_rms_norm(hidden, norm_weight, 1e-6, residual)
                qkv = hopper_gemm.linear(normed, weights["qkv"])
                hidden = hopper_gemm.linear(qkv[:, :2048], weights["o"])
                normed, residual = ops.add_rms_norm(hidden, norm_weight, 1e-6, residual)
                activated = (hopper_gemm.linear(normed, weights["gate_up"], silu_mul=True) if fused
                             else ops.silu_and_mul(hopper_gemm.linear(normed, weights["gate_up"])))
                hidden = hopper_gemm.linear(activated, weights["down"])
            return hidden

        line.append(f"| chain {graph_time_us(lambda: chain(False)) / LAYERS:6.2f}"
                    f" fused {graph_time_us(lambda: chain(True)) / LAYERS:6.2f}")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
