"""A decode projection's copies alone, as the Hopper GEMM makes them, against the same copies shared
within clusters of CTAs by TMA multicast, and against the GEMM itself (GPU, Hopper;
benchmarks/multicast_copy_probe.cu says what a CTA does).

    python3 benchmarks/multicast_copy_probe.py [--rows 256] [--layers 28]

At 256 rows a decode step's four projections take ~35 us a layer on an H100 against ~11 us for their
weights' bytes or products (benchmarks/RESULTS.md), and kernel_boundary_probe.py found that copies
in their tiling's pattern, without products, take about as long. Each CTA of worker/hopper_gemm.py's
tiling copies its row tile's weights and its token tile's activations over all of K: the activations
from L2 once per row tile, the weights once per token tile. This asks whether that data movement
is what bounds them, and whether multicast could cut it:
- `copies`: the tiling's CTAs copying their boxes by TMA through a ring of stages, each stage
  released by a consumer warpgroup that only waits for it;
- `x shared by N`: clusters of N row tiles, each CTA copying 1 / N of every activation box into all N;
- `W shared by N`: clusters of N token tiles sharing the weight boxes the same way;
- `..., lean`: the same, each stage released with one arrival per CTA (the .cu says how);
- `launches`: the same grids and clusters copying nothing;
- `GEMM`: hopper_gemm.linear on the same shapes, as the engine launches it (PDL where it is on).
Every figure is us a projection: a CUDA graph of --layers launches, each layer's weights its own
(so they come from DRAM, as in a decode step), divided by --layers.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for benchmarks.graph_timing

from benchmarks.graph_timing import graph_time_us
from minivllm.worker import hopper_gemm
from minivllm.worker.attention import cuda_build

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multicast_copy_probe.cu")
# Qwen3-0.6B's decode projections, weight [n, k] in bf16
PROJECTIONS = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
SMEM_BUDGET = 200 * 1024  # a stage ring about as big as the Hopper GEMM's (one CTA an SM)
MAX_STAGES = 8


def load_library() -> ctypes.CDLL:
    lib = ctypes.CDLL(cuda_build.built_library(SOURCE, "multicast_copy_probe", "multicast copy probe"))
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.probe_copies.argtypes = [ptr, i32, i32, i32, ptr, i32, i32, i32, i32, i32, i32, i32, ptr, ptr,
                                 ctypes.c_char_p, i32]
    lib.probe_copies.restype = i32
    return lib


def stages_for(token_tile: int) -> int:
    """As many stages of a weight box and an activation box as fit the budget (at most 8)."""
    return min(MAX_STAGES, SMEM_BUDGET // (64 * 128 + token_tile * 128))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256, help="the decode batch (a multiple of each token tile)")
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    lib = load_library()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    error = ctypes.create_string_buffer(512)
    print(f"{props.name}, {sms} SMs; {args.rows} rows, {args.layers} layers' weights; us a projection", flush=True)
    totals: dict[str, float] = {}
    for name, (n, k) in PROJECTIONS.items():
        tile = hopper_gemm.tiling(args.rows, n, k, sms).token_tile
        row_tiles, token_tiles = n // 64, args.rows // tile
        stages = stages_for(tile)
        weights = torch.randn(args.layers * n, k, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(args.rows, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(args.rows, n, dtype=torch.bfloat16, device="cuda")

        def copies(cluster: int, share_w: bool, lean: bool, no_chunks: bool) -> None:
            rc = lib.probe_copies(weights.data_ptr(), args.layers, n, k, x.data_ptr(), args.rows, tile, cluster,
                                  int(share_w), int(lean), stages, int(no_chunks), sink.data_ptr(),
                                  torch.cuda.current_stream().cuda_stream, error, len(error))
            if rc:
                raise RuntimeError(error.value.decode())

        ctas = row_tiles * token_tiles
        intake_mib = ctas * (64 + tile) * k * 2 / 2**20  # what all the CTAs copy into their shared memory
        print(f"{name} [{n} x {k}]: {row_tiles} row tiles x {token_tiles} token tiles of {tile} = {ctas} CTAs, "
              f"{stages} stages; {intake_mib:.0f} MiB to the SMs ({(64 + tile) * k * 2 >> 10} KiB a CTA)", flush=True)
        cases = [("copies", 1, False, False)]
        for cluster in (2, 4):
            for lean in (False, True):
                how = ", lean" if lean else ""
                if tile % (8 * cluster) == 0 and row_tiles % cluster == 0:
                    cases.append((f"x shared by {cluster}{how}", cluster, False, lean))
                if token_tiles % cluster == 0:
                    cases.append((f"W shared by {cluster}{how}", cluster, True, lean))
        for label, cluster, share_w, lean in cases:
            full = graph_time_us(lambda: copies(cluster, share_w, lean, False), calls=1) / args.layers
            empty = graph_time_us(lambda: copies(cluster, share_w, lean, True), calls=1) / args.layers
            print(f"  {label:22} {full:6.2f} us  (launches alone {empty:5.2f}; the copies {full - empty:5.2f})",
                  flush=True)
            if cluster == 1:
                totals[name] = full
        layer_weights = [weights[i * n:(i + 1) * n] for i in range(args.layers)]
        gemm = graph_time_us(lambda: [hopper_gemm.linear(x, w, out) for w in layer_weights]) / args.layers
        print(f"  {'GEMM':22} {gemm:6.2f} us", flush=True)
        totals[name + " GEMM"] = gemm
    print(f"a layer: copies {sum(totals[p] for p in PROJECTIONS):.1f} us, "
          f"GEMMs {sum(totals[p + ' GEMM'] for p in PROJECTIONS):.1f} us")


if __name__ == "__main__":
    main()
