"""Time versions of the Hopper prefill kernel side by side (GPU): each source is built with nvcc
and timed on the same batches, in interleaved rounds, since an H100's clock drifts by up to ~10%
between back-to-back runs of one binary.

    python benchmarks/hopper_variants.py --cases prefill-1x16384+descending,prefill-32k \
        --variant now=worker/attention/hopper_prefill.cu --variant old=/tmp/old.cu [--rounds 5] \
        [--block-size 16] [--rep 25] [--cudagraph]

A case is a tune_attention.py case with an optional +BLOCK_ORDER (scattered, ascending, descending,
shuffled; default scattered). Each variant's line gives the median over rounds and the fastest
round, and says where its outputs are not bit-equal to the first variant's (a different key order
sums in a different order; correctness is tests/gpu/test_hopper_prefill.py's job). Triton's
kernel is timed last on the same batches. Time steps of short prompts with --cudagraph (each
call replayed from a CUDA graph): timed eagerly, Triton's launcher can take longer than its kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.graph_timing import graph_time_us
from benchmarks.tune_attention import CASES, HEAD_DIM, HEADS, build_step, causal_pairs


def main() -> None:
    from minivllm.worker.attention import cuda_build, hopper_prefill
    from minivllm.worker.attention.triton_attention import paged_attention

    from tests.gpu.test_triton_attention import BLOCK_ORDERS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="prefill-1x16384+ascending,prefill-1x16384+descending")
    parser.add_argument("--variant", action="append", required=True, help="NAME=SOURCE.cu (repeat)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per cache block")
    parser.add_argument("--rep", type=int, default=25, help="do_bench milliseconds per timing")
    parser.add_argument("--cudagraph", action="store_true", help="time replays of CUDA graphs (graph_timing.py)")
    args = parser.parse_args()
    nvcc = cuda_build.find_nvcc()
    if nvcc is None:
        raise SystemExit("nvcc not found")
    build_dir = tempfile.mkdtemp(prefix="hopper-variants-")
    libs = {}
    for spec in args.variant:
        name, _, source = spec.partition("=")
        report = cuda_build.compile_library(nvcc, source, os.path.join(build_dir, f"{name}.so"))
        print(name, "|", "; ".join(line.split(":", 1)[-1].strip() for line in report.splitlines()
                                   if "registers" in line or "spill" in line))
        libs[name] = hopper_prefill.load_library(os.path.join(build_dir, f"{name}.so"))

    for spec in args.cases.split(","):
        case, _, order = spec.partition("+")
        order = order or "scattered"
        if order not in BLOCK_ORDERS:
            raise SystemExit(f"block order must be one of {BLOCK_ORDERS}, got {order!r}")
        steps = [build_step(cases, False, 257, order, args.block_size) for cases in CASES[case]]
        tflop = 4 * sum(causal_pairs(c, n) for cases in CASES[case] for c, n in cases) * HEAD_DIM * HEADS / 1e12

        outputs = {name: [torch.empty_like(q) for q, *_ in steps] for name in libs}

        def run(lib, outs, steps=steps):
            for (q, cache, metadata, _, _), out in zip(steps, outs):
                hopper_prefill.prefill_attention(q, cache, metadata.layout(cache), metadata, HEAD_DIM**-0.5, out, lib)
            return outs

        def ms(fn):
            if args.cudagraph:
                return graph_time_us(fn, calls=4) / 1000
            return do_bench(fn, warmup=5, rep=args.rep, return_mode="median")

        first = None
        differs = {}
        for name, lib in libs.items():
            outs = run(lib, outputs[name])
            first = first or outs
            differs[name] = not all(torch.equal(a, b) for a, b in zip(outs, first))
        times = {name: [] for name in libs}
        for _ in range(args.rounds):
            for name, lib in libs.items():
                times[name].append(ms(lambda lib=lib, outs=outputs[name]: run(lib, outs)))
        cells = []
        for name, runs in times.items():
            median = statistics.median(runs)
            cells.append(f"{name} {median * 1000:.0f} us {tflop / median * 1000:.0f} TF [min {min(runs) * 1000:.0f}]"
                         + (" (differs)" if differs[name] else ""))
        hopper_prefill.ENABLED = False  # paged_attention would route these steps to the default build
        triton = ms(lambda steps=steps: [paged_attention(q, cache, md, HEAD_DIM**-0.5) for q, cache, md, _, _ in steps])
        hopper_prefill.ENABLED = True
        cells.append(f"triton {triton * 1000:.0f} us {tflop / triton * 1000:.0f} TF")
        print(f"{case} {order} bs{args.block_size}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
