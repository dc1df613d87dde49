"""The decode kernel inside a decode step's chain of kernels against the kernel alone.

    python3 benchmarks/decode_in_context_probe.py [--fp8] [--ragged]   # on the device machine

256 sequences of 700 keys (--ragged: tune_attention's decode-256xragged, 100-1,280), blocks in
ascending runs as a fresh engine hands them out; CUDA graphs of 28 layers, us a layer:
- `same cache`: every layer reads one cache, as tune_attention.py replays it;
- `28 caches`: each layer its own cache, as the engine's layers have;
- `28 caches + projections`: each attention kernel followed by a layer's add + RMSNorm and four
  projections (28 layers of weights, 256 rows), so that it starts after a down projection, as the
  engine's starts after qkv's; `attention` is that minus `projections alone`.
With PDL (the default) consecutive attention kernels overlap one's tail with the next one's first
copies; between projections they cannot, and the difference is what the ramp and the tail cost
inside a step. benchmarks/results/2026-11-28-step-probes/ has the H100's figures.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.graph_timing import graph_time_us
from benchmarks.tune_attention import CASES, HEAD_DIM, build_step
from minivllm.worker import hopper_gemm, ops
from minivllm.worker.attention import triton_attention

LAYERS = 28
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--ragged", action="store_true", help="tune_attention's decode-256xragged contexts instead")
    args = parser.parse_args()
    cases = CASES["decode-256xragged"][0] if args.ragged else [(args.context, 1)] * 256
    q, cache, md, _, _ = build_step(cases, args.fp8, block_order="ascending")
    caches = [cache] + [cache.clone() for _ in range(LAYERS - 1)]
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    dev = q.device
    weights = [{n: torch.randn(r, c, device=dev, dtype=torch.bfloat16) * 0.03 for n, (r, c) in SHAPES.items()}
               for _ in range(LAYERS)]
    norm_weight = torch.ones(1024, device=dev, dtype=torch.bfloat16)
    hidden0 = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)

    def attend(layer: int, own: bool) -> None:
        triton_attention.decode_attention(q, caches[layer] if own else cache, md, scale, out=out)

    def projections(layer: int, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = weights[layer]
        normed, residual = ops.add_rms_norm(hidden, norm_weight, 1e-6, residual)
        hopper_gemm.linear(normed, w["qkv"])
        hidden = hopper_gemm.linear(out.view(256, 2048), w["o"])
        normed, residual = ops.add_rms_norm(hidden, norm_weight, 1e-6, residual)
        hidden = hopper_gemm.linear(hopper_gemm.linear(normed, w["gate_up"], silu_mul=True), w["down"])
        return hidden, residual

    def chain(with_attention: bool) -> None:
        hidden, residual = hidden0, hidden0.clone()
        for layer in range(LAYERS):
            if with_attention:
                attend(layer, True)
            hidden, residual = projections(layer, hidden, residual)

    same = graph_time_us(lambda: [attend(i, False) for i in range(LAYERS)]) / LAYERS
    own = graph_time_us(lambda: [attend(i, True) for i in range(LAYERS)]) / LAYERS
    proj = graph_time_us(lambda: chain(False)) / LAYERS
    both = graph_time_us(lambda: chain(True)) / LAYERS
    shape = "100-1,280" if args.ragged else args.context
    print(f"{torch.cuda.get_device_name()} {'fp8' if args.fp8 else 'bf16'} 256 x {shape}, "
          f"PDL {os.environ.get('MINIVLLM_PDL', '1')}: us a layer: "
          f"same cache {same:.1f}  28 caches {own:.1f}  projections alone {proj:.1f}  "
          f"28 caches + projections {both:.1f} (attention {both - proj:.1f})", flush=True)


if __name__ == "__main__":
    main()
