"""What each part of linear_rope's K/V store costs: the qkv projection alone, and in a decode step's
28 layers, with parts of its epilogue left out.

    python3 benchmarks/rope_epilogue_probe.py [--variants NAME,...] [--caches fp8,bf16]   # on the device machine

With an FP8 cache the qkv projection (hopper_gemm.linear_rope) takes ~2 us longer at 256 rows than
with a bf16 one, and in a step its k and v heads' CTAs end ~2.5 us after its q heads'
(benchmarks/results/2026-11-28-rope-passes/). This probe builds hopper_gemm.cu with one store or
another of rope_tokens' epilogue never made (VARIANTS: bounds, not kernels; what they leave in the
cache is wrong), then, interleaved over rounds:
- times linear_rope alone at 256 rows (28 calls a graph; us a call);
- times DecodeLayers' step (add + RMSNorm, linear_rope, attention, o, add + RMSNorm, gate|up with
  SiLU-and-mul, down; 256 sequences of tune_attention's ragged 100-1,280 keys; us a layer).
Its first form (commit cb6e1d0) built the epilogue with 1-6 tokens a warp at a time instead
(tried_rope_passes.diff there): no faster, and bit-equal. Call 3 there also ran the variants "no L2
fill" and "no L2 fill of values" against a build that pulled the partly written sectors into L2
first (tried_l2_fill.diff): no faster either.
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

# A store that is never made: the condition is false at run time, which the compiler cannot know.
NEVER = "if (r.block_size < 0) "
VALUE_BYTES = "          values[32 * k * r.v_dim_stride] = static_cast<uint8_t>(word >> (8 * (lane % 4)));\n"
KEY_BYTES = "        reinterpret_cast<uint32_t*>(keys)[lane] = e4m3;\n"
KEY_SCALE = "        if (lane == 0) r.k_scale[scale_at]"
VALUE_SCALE = "        if (lane == 0) r.v_scale[scale_at]"
Y_ROW = "    *reinterpret_cast<uint2*>(p.y + static_cast<int64_t>(token) * p.y_stride + head * 128 + 4 * lane) = packed;\n"
VALUE_LOOP = ("#pragma unroll\n        for (int k = 0; k < 4; ++k) {\n"
              "          const uint32_t word = __shfl_sync(0xffffffffu, e4m3, 8 * k + lane / 4);\n" + VALUE_BYTES +
              "        }\n")
# name -> (what the source has, what the build has instead)
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "as built": [],
    "no value bytes": [(VALUE_BYTES, VALUE_BYTES.replace("values[", NEVER + "values["))],
    "no key bytes": [(KEY_BYTES, KEY_BYTES.replace("reinterpret_cast", NEVER + "reinterpret_cast", 1))],
    "no scales": [(KEY_SCALE, KEY_SCALE.replace("if (lane == 0)", "if (lane == 0 && r.block_size < 0)")),
                  (VALUE_SCALE, VALUE_SCALE.replace("if (lane == 0)", "if (lane == 0 && r.block_size < 0)"))],
    "no K/V stores": [],  # (all three above: filled in below)
    # the value's 128 bytes as one 128-byte row, as a key's are (the wrong layout; what it would cost)
    "values as one row": [(VALUE_LOOP, "        reinterpret_cast<uint32_t*>(values - lane * r.v_dim_stride + "
                                       "- offset * r.v_slot_stride + 128 * offset)[lane] = e4m3;\n")],
    "no k/v rows of y": [(Y_ROW, "    if (is_q) " + Y_ROW.lstrip())],
}
VARIANTS["no K/V stores"] = VARIANTS["no value bytes"] + VARIANTS["no key bytes"] + VARIANTS["no scales"]


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


def variant_text(edits: list[tuple[str, str]]) -> str:
    with open(hopper_gemm.SOURCE) as f:
        text = f.read()
    for old, new in edits:
        assert text.count(old) == 1, f"hopper_gemm.cu changed; the probe's edit no longer applies: {old!r}"
        text = text.replace(old, new)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--caches", default="fp8,bf16")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    libraries = {name: build(variant_text(VARIANTS[name])) for name in args.variants.split(",")}
    built = hopper_gemm.library()
    cases = CASES["decode-256xragged"][0]
    steps = {}
    for cache_name in args.caches.split(","):
        q, cache, md, _, _ = build_step(cases, cache_name == "fp8", block_order="ascending")
        steps[cache_name] = DecodeLayers(q, cache, md)
    print(f"{torch.cuda.get_device_name()}, 256 sequences of 100-1,280 keys; qkv alone in us a call, the step in us "
          "a layer", flush=True)

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
