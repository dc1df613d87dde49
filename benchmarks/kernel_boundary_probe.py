"""What a kernel boundary costs in a decode step's chain of short kernels, against a grid-wide barrier
inside one persistent kernel, and how long the projections' data movement takes with no arithmetic
(benchmarks/kernel_boundary_probe.cu says what a phase is).

    python3 benchmarks/kernel_boundary_probe.py [--layers 28] [--rows 256] [--smem-kib 0 200]   # Hopper

A decode step's four projections take ~35 us a layer on an H100 at 256 rows against ~11 us for
their weights' bytes (benchmarks/RESULTS.md). This asks how much of that the boundaries between
kernels and the copies alone explain. Three sets of phases, 4 a layer:
- `ordering`: no copies, only the dependent word: what ordering the phases costs, us a phase;
- `weights`: each projection's weights (qkv 8 MiB, o 4, gate|up 12, down 6; every layer its own, so
  L2 does not serve them), split evenly over one CTA an SM;
- `gemm-like`: what worker/hopper_gemm.py's tiling at --rows rows has each CTA copy: its 64 weight
  rows over all of K (from DRAM) and its token tile's x over all of K (served by L2), with as many CTAs
  as that tiling launches (the plain kernel's tiling: qkv's rope variant takes 128-row heads instead).
Each set runs as a chain without PDL, a chain with PDL (the weights copied after the wait, or before
it as the Hopper GEMM does), and as one persistent kernel (weights after or before its barrier). The
last two sets print us a layer, against the weights' bytes at the rate one kernel streaming all of
the layers' weights reaches.

Each is measured with every CTA asking for --smem-kib of shared memory it leaves unused: with 0 a
chain's next kernel can start on every SM while the one ahead runs; with ~200 KiB, as with the Hopper
GEMM's CTAs, one CTA fits an SM. Every figure is the median of CUDA graph replays
(benchmarks/graph_timing.py), less a graph of the buffer reset alone. Each run checks that no CTA
read a word before the phase ahead wrote it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for benchmarks.graph_timing

from benchmarks.graph_timing import graph_time_us
from minivllm.worker import hopper_gemm
from minivllm.worker.attention import cuda_build

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_boundary_probe.cu")
# Qwen3-0.6B's decode projections, weight [n, k] in bf16
PROJECTIONS = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
WORD = 16  # bytes a load


class PHASE(ctypes.Structure):
    """kernel_boundary_probe.cu's Phase, field for field."""
    _fields_ = [("weights", ctypes.c_void_p), ("w_words", ctypes.c_int64), ("x", ctypes.c_void_p),
                ("x_words", ctypes.c_int64), ("ctas", ctypes.c_int64), ("row_tiles", ctypes.c_int64)]


class PhaseShape(NamedTuple):
    ctas: int
    row_tiles: int  # CTA c copies row tile c % row_tiles's weights and token tile c // row_tiles's x
    w_bytes_per_cta: int
    x_bytes_per_cta: int


def load_library() -> ctypes.CDLL:
    lib = ctypes.CDLL(cuda_build.built_library(SOURCE, "kernel_boundary_probe", "kernel boundary probe"))
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.probe_chain.argtypes = [ptr, i32, ptr, ptr, i32, i32, i32, i32, i32, ptr, ctypes.c_char_p, i32]
    lib.probe_chain.restype = i32
    lib.probe_persistent.argtypes = [ptr, i32, ptr, ptr, ptr, i32, i32, i32, i32, ptr, ctypes.c_char_p, i32]
    lib.probe_persistent.restype = i32
    return lib


def gemm_like(rows: int, num_sms: int) -> list[PhaseShape]:
    """Per projection, what the Hopper GEMM's tiling at `rows` rows launches and has a CTA copy."""
    shapes = []
    for n, k in PROJECTIONS.values():
        tile = hopper_gemm.tiling(rows, n, k, num_sms).token_tile
        shapes.append(PhaseShape((n // 64) * -(-rows // tile), n // 64, 64 * k * 2, tile * k * 2))
    return shapes


class Phases:
    """A run of phases, each with weights of its own and the activations buffer shared by all."""

    def __init__(self, lib: ctypes.CDLL, shapes: list[PhaseShape], grid: int, threads: int) -> None:
        self.lib, self.grid, self.threads = lib, grid, threads
        self.smem = 0  # bytes of shared memory each CTA asks for
        x_bytes = max(max(-(-s.ctas // s.row_tiles) * s.x_bytes_per_cta for s in shapes), WORD)
        self.x = torch.randint(-2**31, 2**31 - 1, (x_bytes // 4,), dtype=torch.int32, device="cuda")
        self.weights = [torch.randint(-2**31, 2**31 - 1, (max(s.row_tiles * s.w_bytes_per_cta, WORD) // 4,),
                                      dtype=torch.int32, device="cuda") for s in shapes]
        fields = [(w.data_ptr(), s.w_bytes_per_cta // WORD, self.x.data_ptr(), s.x_bytes_per_cta // WORD, s.ctas,
                   s.row_tiles) for w, s in zip(self.weights, shapes)]
        assert all(s.ctas <= grid for s in shapes), (grid, shapes[:4])
        self.host_phases = (PHASE * len(fields))(*[PHASE(*f) for f in fields])
        self.device_phases = torch.tensor(fields, dtype=torch.int64, device="cuda")  # the same 48-byte rows
        self.bufs = torch.zeros(len(fields) + 1, grid, dtype=torch.int32, device="cuda")
        self.arrived = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.sink = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.error = ctypes.create_string_buffer(512)

    @property
    def num_phases(self) -> int:
        return len(self.weights)

    def chain(self, pdl: bool, weights_first: bool) -> None:
        self.bufs.zero_()
        rc = self.lib.probe_chain(ctypes.addressof(self.host_phases), self.num_phases, self.bufs.data_ptr(),
                                  self.sink.data_ptr(), self.grid, self.threads, self.smem, int(pdl),
                                  int(weights_first), torch.cuda.current_stream().cuda_stream, self.error,
                                  len(self.error))
        if rc:
            raise RuntimeError(self.error.value.decode())

    def persistent(self, weights_first: bool) -> None:
        self.bufs.zero_()
        rc = self.lib.probe_persistent(self.device_phases.data_ptr(), self.num_phases, self.bufs.data_ptr(),
                                       self.arrived.data_ptr(), self.sink.data_ptr(), self.grid, self.threads,
                                       self.smem, int(weights_first), torch.cuda.current_stream().cuda_stream,
                                       self.error, len(self.error))
        if rc:
            raise RuntimeError(self.error.value.decode())

    def timed_us(self, run) -> float:
        """us of run() less the reset it starts with, after checking its ordering once."""
        run()
        torch.cuda.synchronize()
        final = self.bufs[-1]
        if not bool((final == self.num_phases).all()):
            raise RuntimeError(f"a CTA read a word before it was written: {final.unique().tolist()[:8]}")
        return graph_time_us(run) - graph_time_us(self.bufs.zero_)

    def cases(self) -> dict[str, float]:
        """us of the whole run of phases, each way of running them."""
        return {
            "chain without PDL": self.timed_us(lambda: self.chain(pdl=False, weights_first=False)),
            "chain with PDL, weights after the wait": self.timed_us(lambda: self.chain(pdl=True, weights_first=False)),
            "chain with PDL, weights before the wait": self.timed_us(lambda: self.chain(pdl=True, weights_first=True)),
            "persistent, weights after the barrier": self.timed_us(lambda: self.persistent(weights_first=False)),
            "persistent, weights before the barrier": self.timed_us(lambda: self.persistent(weights_first=True)),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rows", type=int, default=256, help="the decode batch the gemm-like set's tiling is for")
    parser.add_argument("--threads", type=int, default=512)
    parser.add_argument("--smem-kib", type=int, nargs="+", default=[0, 200],
                        help="shared memory each CTA asks for (and leaves unused), one pass each")
    args = parser.parse_args()
    lib = load_library()
    props = torch.cuda.get_device_properties(0)
    grid = props.multi_processor_count
    layer_bytes = sum(n * k * 2 for n, k in PROJECTIONS.values())
    tiled = gemm_like(args.rows, grid)
    print(f"{props.name}, {grid} SMs, {args.threads} threads a CTA; {args.layers} layers x 4 projections; "
          f"gemm-like at {args.rows} rows (CTAs, KiB of weights and of x each): "
          + ", ".join(f"{name} {s.ctas} / {s.w_bytes_per_cta >> 10} / {s.x_bytes_per_cta >> 10}"
                      for name, s in zip(PROJECTIONS, tiled)), flush=True)
    sets = {
        "ordering": Phases(lib, [PhaseShape(grid, grid, 0, 0)] * (4 * args.layers), grid, args.threads),
        "weights": Phases(lib, [PhaseShape(grid, grid, n * k * 2 // grid // WORD * WORD, 0)
                                for n, k in PROJECTIONS.values()] * args.layers, grid, args.threads),
        "gemm-like": Phases(lib, tiled * args.layers, grid, args.threads),
    }
    whole = Phases(lib, [PhaseShape(grid, grid, layer_bytes * args.layers // grid // WORD * WORD, 0)], grid,
                   args.threads)
    for smem_kib in args.smem_kib:
        print(f"== every CTA asks for {smem_kib} KiB of shared memory", flush=True)
        for phases in (*sets.values(), whole):
            phases.smem = smem_kib * 1024
        stream_us = whole.timed_us(lambda: whole.chain(pdl=False, weights_first=False))
        tbps = layer_bytes * args.layers / stream_us / 1e6
        floor = layer_bytes / tbps / 1e6
        print(f"one kernel streaming all {layer_bytes * args.layers >> 20} MiB of weights: {stream_us:.1f} us "
              f"({tbps:.2f} TB/s); a layer's at that rate: {floor:.2f} us", flush=True)
        for set_name, phases in sets.items():
            for case, us in phases.cases().items():
                if set_name == "ordering":
                    print(f"  {set_name:9} {case:40} {us / phases.num_phases:7.2f} us a phase", flush=True)
                else:
                    per_layer = us / args.layers
                    print(f"  {set_name:9} {case:40} {per_layer:7.2f} us a layer "
                          f"({per_layer / floor:.2f}x the weights' bytes)", flush=True)

if __name__ == "__main__":
    main()
