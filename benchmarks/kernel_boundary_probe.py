"""What a kernel boundary costs in a decode step's chain of short kernels, against a grid-wide barrier
inside one persistent kernel (benchmarks/kernel_boundary_probe.cu says what a phase is).

    python3 benchmarks/kernel_boundary_probe.py [--layers 28] [--grid N] [--threads 512] [--smem-kib 0 200]

A decode step's four projections take ~35 us a layer on an H100 at 256 rows against ~11 us for
their weights' bytes (benchmarks/RESULTS.md). This asks how much of that a boundary between kernels
can explain, with no arithmetic at all:
- the ordering alone: phases with no weights, us a phase, as a chain of kernels without PDL, a chain
  with PDL, and one persistent kernel whose CTAs wait on a counter between phases;
- the projections' weight sizes (qkv 8 MiB, o 4, gate|up 12, down 6; every layer its own, so L2
  does not serve them), us a layer, streamed after each phase's wait or before it (as
  worker/hopper_gemm.cu loads its weights), against the bytes' time at the rate one kernel streaming
  all of them reaches.

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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for benchmarks.graph_timing

from benchmarks.graph_timing import graph_time_us
from minivllm.worker.attention import cuda_build

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_boundary_probe.cu")
# Qwen3-0.6B's decode projections, bytes of bf16 weights: [n, k] * 2
PROJECTION_BYTES = {"qkv": 4096 * 1024 * 2, "o": 1024 * 2048 * 2, "gate_up": 6144 * 1024 * 2, "down": 1024 * 3072 * 2}


def load_library() -> ctypes.CDLL:
    lib = ctypes.CDLL(cuda_build.built_library(SOURCE, "kernel_boundary_probe", "kernel boundary probe"))
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.probe_chain.argtypes = [ptr, i32, ptr, ptr, i32, i32, i32, i32, i32, ptr, ctypes.c_char_p, i32]
    lib.probe_chain.restype = i32
    lib.probe_persistent.argtypes = [ptr, i32, ptr, ptr, ptr, i32, i32, i32, i32, ptr, ctypes.c_char_p, i32]
    lib.probe_persistent.restype = i32
    return lib


class Phases:
    """A run of phases, each with weights of its own ([phase] bytes, split evenly over the CTAs)."""

    def __init__(self, lib: ctypes.CDLL, phase_bytes: list[int], grid: int, threads: int) -> None:
        self.lib, self.grid, self.threads = lib, grid, threads
        self.smem = 0  # bytes of shared memory each CTA asks for
        self.words_per_cta = [size // 16 // grid for size in phase_bytes]
        self.weights = [torch.randint(-2**31, 2**31 - 1, (max(words * grid, 1) * 4,), dtype=torch.int32, device="cuda")
                        for words in self.words_per_cta]
        pairs = [(w.data_ptr(), words) for w, words in zip(self.weights, self.words_per_cta)]
        self.host_pairs = (ctypes.c_int64 * (2 * len(pairs)))(*[v for pair in pairs for v in pair])
        self.device_pairs = torch.tensor(pairs, dtype=torch.int64, device="cuda")
        self.bufs = torch.zeros(len(pairs) + 1, grid, dtype=torch.int32, device="cuda")
        self.arrived = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.sink = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.error = ctypes.create_string_buffer(512)

    @property
    def num_phases(self) -> int:
        return len(self.words_per_cta)

    def chain(self, pdl: bool, weights_first: bool) -> None:
        self.bufs.zero_()
        rc = self.lib.probe_chain(self.host_pairs, self.num_phases, self.bufs.data_ptr(), self.sink.data_ptr(),
                                  self.grid, self.threads, self.smem, int(pdl), int(weights_first),
                                  torch.cuda.current_stream().cuda_stream, self.error, len(self.error))
        if rc:
            raise RuntimeError(self.error.value.decode())

    def persistent(self, weights_first: bool) -> None:
        self.bufs.zero_()
        rc = self.lib.probe_persistent(self.device_pairs.data_ptr(), self.num_phases, self.bufs.data_ptr(),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--grid", type=int, default=0, help="CTAs (default: one per SM)")
    parser.add_argument("--threads", type=int, default=512)
    parser.add_argument("--smem-kib", type=int, nargs="+", default=[0, 200],
                        help="shared memory each CTA asks for (and leaves unused), one pass each")
    args = parser.parse_args()
    lib = load_library()
    props = torch.cuda.get_device_properties(0)
    grid = args.grid or props.multi_processor_count
    print(f"{props.name}, {props.multi_processor_count} SMs; grid {grid} x {args.threads} threads; "
          f"{args.layers} layers x 4 projections", flush=True)

    empty = Phases(lib, [0] * (4 * args.layers), grid, args.threads)
    layer_bytes = sum(PROJECTION_BYTES.values())
    whole = Phases(lib, [layer_bytes * args.layers], grid, args.threads)
    weighted = Phases(lib, list(PROJECTION_BYTES.values()) * args.layers, grid, args.threads)
    n = empty.num_phases
    for smem_kib in args.smem_kib:
        empty.smem = whole.smem = weighted.smem = smem_kib * 1024
        print(f"== every CTA asks for {smem_kib} KiB of shared memory", flush=True)
        no_pdl = empty.timed_us(lambda: empty.chain(pdl=False, weights_first=False)) / n
        with_pdl = empty.timed_us(lambda: empty.chain(pdl=True, weights_first=False)) / n
        persistent = empty.timed_us(lambda: empty.persistent(weights_first=False)) / n
        print(f"ordering alone, us a phase over {n}: chain without PDL {no_pdl:.2f}, chain with PDL {with_pdl:.2f}, "
              f"persistent {persistent:.2f}", flush=True)

        stream_us = whole.timed_us(lambda: whole.chain(pdl=False, weights_first=False))
        tbps = layer_bytes * args.layers / stream_us / 1e6
        floor = layer_bytes / tbps / 1e6
        print(f"one kernel streaming {layer_bytes * args.layers / 2**20:.0f} MiB: {stream_us:.1f} us "
              f"({tbps:.2f} TB/s); a layer's {layer_bytes / 2**20:.0f} MiB at that rate: {floor:.2f} us", flush=True)

        cases = {
            "chain without PDL": lambda: weighted.chain(pdl=False, weights_first=False),
            "chain with PDL, weights after the wait": lambda: weighted.chain(pdl=True, weights_first=False),
            "chain with PDL, weights before the wait": lambda: weighted.chain(pdl=True, weights_first=True),
            "persistent, weights after the wait": lambda: weighted.persistent(weights_first=False),
            "persistent, weights before the wait": lambda: weighted.persistent(weights_first=True),
        }
        for name, run in cases.items():
            per_layer = weighted.timed_us(run) / args.layers
            print(f"  {name:42} {per_layer:7.2f} us a layer ({per_layer / floor:.2f}x the bytes' time)", flush=True)

if __name__ == "__main__":
    main()
