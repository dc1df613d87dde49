"""linear_rope's epilogue with each warp carrying 1, 2, 3 or 6 tokens at a time: the qkv projection
alone, and a decode step's 28 layers, with an FP8 and a bf16 cache.

    python3 benchmarks/rope_epilogue_probe.py [--baseline OLD.cu] [--passes 1,2,3,6]   # on the device machine

The qkv projection's epilogue (hopper_gemm.cu's rope_tokens) normalizes, rotates and stores one
token's head vector per warp as a chain of dependent steps. In an FP8 step the k and v heads' CTAs,
which also quantize and store into the cache, ended ~2.5 us after the q heads' and held up the
attention kernel after them (benchmarks/results/2026-11-28-qkv-overlap/call5_log.txt). This probe
builds hopper_gemm.cu with kRopeTokensAPass set to each count (and OLD.cu as it is, if given: the
source before the epilogue took several tokens), then, interleaved over rounds:
- times linear_rope alone at 256 rows (28 calls a graph; us a call);
- times DecodeLayers' step (add + RMSNorm, linear_rope, attention, o, add + RMSNorm, gate|up with
  SiLU-and-mul, down; 256 sequences of tune_attention's ragged 100-1,280 keys; us a layer);
- checks that every build leaves the same bits in y, in the cache, and in the step's attention output
  as the first build.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.graph_timing import graph_time_us
from benchmarks.qkv_attention_overlap_probe import LAYERS, DecodeLayers
from benchmarks.tune_attention import CASES, build_step
from minivllm.protocol.config import cache_root
from minivllm.worker import hopper_gemm
from minivllm.worker.attention.cuda_build import compile_library, find_nvcc

PASS = "constexpr int kRopeTokensAPass = "


def build(text: str) -> ctypes.CDLL:
    """hopper_gemm.cu's text built once per machine beside its header, and loaded."""
    directory = os.path.join(str(cache_root()), "kernels", "rope-epilogue-probe",
                             hashlib.sha1(text.encode()).hexdigest()[:12])
    target = os.path.join(directory, "hopper_gemm.so")
    if not os.path.exists(target):
        os.makedirs(directory, exist_ok=True)
        shutil.copy(os.path.join(os.path.dirname(hopper_gemm.SOURCE), "hopper_ptx.cuh"), directory)
        with open(os.path.join(directory, "hopper_gemm.cu"), "w") as f:
            f.write(text)
        compile_library(find_nvcc(), os.path.join(directory, "hopper_gemm.cu"), target + ".tmp")
        os.replace(target + ".tmp", target)
    return hopper_gemm.load_library(target)


def variants(baseline: str | None, passes: list[int]) -> dict[str, str]:
    """name -> source text."""
    with open(hopper_gemm.SOURCE) as f:
        engine = f.read()
    assert engine.count(PASS) == 1, "hopper_gemm.cu's kRopeTokensAPass moved: update the probe"
    current = int(engine.split(PASS, 1)[1].split(";", 1)[0])
    out = {}
    if baseline is not None:
        with open(baseline) as f:
            out["baseline"] = f.read()
    for n in passes:
        label = f"{n} a pass" + (" (the engine's)" if n == current else "")
        out[label] = engine.replace(f"{PASS}{current};", f"{PASS}{n};")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="another hopper_gemm.cu, built as it is")
    parser.add_argument("--passes", default="1,2,3,6")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sources = variants(args.baseline, [int(x) for x in args.passes.split(",")])
    libraries = {name: build(text) for name, text in sources.items()}
    built = hopper_gemm.library()
    cases = CASES["decode-256xragged"][0]
    steps = {}
    for fp8 in (True, False):
        q, cache, md, _, _ = build_step(cases, fp8, block_order="ascending")
        steps["fp8" if fp8 else "bf16"] = DecodeLayers(q, cache, md)
    print(f"{torch.cuda.get_device_name()}, 256 sequences of 100-1,280 keys; qkv alone in us a call, the step in us "
          "a layer", flush=True)

    # Bits first: each build's y, cache and step output against the first build's.
    reference: dict[str, list[torch.Tensor]] = {}
    for name, lib in libraries.items():
        hopper_gemm.library = lambda lib=lib: lib
        for cache_name, layers in steps.items():
            y = hopper_gemm.linear_rope(layers.hidden0, layers.weights[0]["qkv"], layers.ropes[0])
            layers.run()
            got = [y.clone(), layers.caches[0].clone(), layers.out.clone()]
            if cache_name not in reference:
                reference[cache_name] = got
                continue
            same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, reference[cache_name])]
            print(f"  {name}, {cache_name}: bit-equal to the first build in y {same[0]}, cache {same[1]}, "
                  f"step output {same[2]}", flush=True)
    hopper_gemm.library = lambda: built

    for round_ in range(args.rounds):
        for name, lib in libraries.items():
            hopper_gemm.library = lambda lib=lib: lib
            try:
                line = []
                for cache_name, layers in steps.items():
                    qkv = graph_time_us(lambda layers=layers: hopper_gemm.linear_rope(
                        layers.hidden0, layers.weights[0]["qkv"], layers.ropes[0]), calls=LAYERS)
                    step = graph_time_us(layers.run) / LAYERS
                    line.append(f"{cache_name}: qkv {qkv:6.2f} step {step:6.1f}")
            finally:
                hopper_gemm.library = lambda: built
            print(f"round {round_} {name:<24} " + "   ".join(line), flush=True)


if __name__ == "__main__":
    main()
