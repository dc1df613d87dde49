"""What each part of linear_rope's K/V store costs: the qkv projection alone, and in a decode step's
28 layers, with parts of its epilogue left out.

    python3 benchmarks/rope_epilogue_probe.py [--variants NAME,...] [--caches fp8,bf16]   # on the device machine

This probe builds hopper_gemm.cu with one store or another of rope_tokens' epilogue never made
(VARIANTS: bounds, not kernels; what they leave in the cache is wrong), and fp8_decode.cu with the
variants of ATTENTION_VARIANTS, then, interleaved over rounds:
- times linear_rope alone at 256 rows (28 calls a graph; us a call);
- times DecodeLayers' step (add + RMSNorm, linear_rope, attention, o, add + RMSNorm, gate|up with
  SiLU-and-mul, down; 256 sequences of tune_attention's ragged 100-1,280 keys; us a layer);
- times the decode kernel alone (28 calls a graph; us a call).

It found why an FP8 step's qkv projection took ~2 us longer than a bf16 one's and its k and v
heads' CTAs ended ~2.5 us after its q heads': values were stored transposed, one byte into each of
128 rows a token, and leaving those bytes out (or writing them as one row) made the step ~3-4 us a
layer faster; values are now stored as rows (kv_cache.py). benchmarks/results/2026-11-28-rope-passes/
has the H100's figures; its calls 1-6 ran this probe's earlier forms on the transposed layout
(commits cb6e1d0, 5b2d1a2 and 1291f35: their variants' edits apply to those trees' sources).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.graph_timing import graph_time_us
from benchmarks.qkv_attention_overlap_probe import LAYERS, DecodeLayers
from benchmarks.kernel_variants import built_text, edited_text
from benchmarks.tune_attention import CASES, HEAD_DIM, build_step
from minivllm.worker import hopper_gemm
from minivllm.worker.attention import fp8_decode, triton_attention

# A store that is never made: the condition is false at run time, which the compiler cannot know.
NEVER = "if (r.block_size < 0) "
KV_BYTES = "      reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(is_k ? r.k_cache : r.v_cache) + row)[lane] = e4m3;\n"
SCALES = "      if (lane == 0) {\n        (is_k ? r.k_scale : r.v_scale)"
Y_ROW = "    *reinterpret_cast<uint2*>(p.y + static_cast<int64_t>(token) * p.y_stride + head * 128 + 4 * lane) = packed;\n"
# name -> (what the source has, what the build has instead)
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "as built": [],
    "no K/V bytes": [(KV_BYTES, KV_BYTES.replace("reinterpret_cast", NEVER + "reinterpret_cast", 1))],
    "no scales": [(SCALES, SCALES.replace("if (lane == 0)", "if (lane == 0 && r.block_size < 0)"))],
    "no k/v rows of y": [(Y_ROW, "    if (is_q) " + Y_ROW.lstrip())],
}
VARIANTS["no K/V stores"] = VARIANTS["no K/V bytes"] + VARIANTS["no scales"]

# fp8_decode.cu, by name: "write back" has the warp that attended a sequence's last block store that
# block's values and scales back from its stage, whole, as a decode kernel would that wrote the
# step's values and scales itself, a whole block at a time (a bound: the stage's value chunks are
# swizzled, so the bytes land permuted).
LOOP_END = ("    attend_tile(st, tile, query, slot0, slot1, seq_len - (first + kWarps * m) * kBlockSize, p.scale_log2);\n"
            "  }\n")
WRITE_BACK = """  if (my_blocks > 0 && first + kWarps * (my_blocks - 1) == num_blocks - 1) {
    const uint8_t* stage = ring + ((my_blocks - 1) % kStages) * kStageBytes;
    const int64_t block_id = table[num_blocks - 1];
    uint8_t* values = const_cast<uint8_t*>(p.value_cache) + block_id * p.stride_block + kv_head * p.stride_value_head;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      reinterpret_cast<uint4*>(values)[lane + 32 * i] = reinterpret_cast<const uint4*>(stage + kKeyBytes)[lane + 32 * i];
    if (lane < 4) {
      __nv_bfloat16* scales = const_cast<__nv_bfloat16*>(lane < 2 ? p.key_scale : p.value_scale) +
                              block_id * p.stride_scale_block + kv_head * p.stride_scale_head;
      *reinterpret_cast<uint4*>(scales + (lane % 2) * 8) = reinterpret_cast<const uint4*>(stage + 2 * kKeyBytes)[lane];
    }
  }
"""
ATTENTION_VARIANTS: dict[str, list[tuple[str, str]]] = {"as built": [], "write back": [(LOOP_END, LOOP_END + WRITE_BACK)]}
BUILD_TAG = "rope-epilogue-probe"  # (the builds' folder under $MINIVLLM_CACHE/kernels)


def variant_libraries(spec: str) -> tuple[ctypes.CDLL, ctypes.CDLL | None]:
    """'GEMM variant[+GEMM variant...][@attention variant]' -> (hopper_gemm, fp8_decode or None: the engine's)."""
    gemm, _, attention = spec.partition("@")
    gemm_text = edited_text(hopper_gemm.SOURCE, [edit for name in gemm.split("+") for edit in VARIANTS[name]])
    gemm_lib = built_text(gemm_text, "hopper_gemm.cu", hopper_gemm.load_library, BUILD_TAG)
    if not attention or attention == "as built":
        return gemm_lib, None
    attention_text = edited_text(fp8_decode.SOURCE, ATTENTION_VARIANTS[attention])
    return gemm_lib, built_text(attention_text, "fp8_decode.cu", fp8_decode.load_library, BUILD_TAG)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"','-separated, each 'GEMM[+GEMM...][@ATTENTION]': GEMM variants of {', '.join(VARIANTS)}; "
                             f"ATTENTION one of {', '.join(ATTENTION_VARIANTS)}")
    parser.add_argument("--caches", default="fp8,bf16")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    libraries = {spec: variant_libraries(spec) for spec in args.variants.split(",")}
    built, built_attention = hopper_gemm.library(), fp8_decode.library()
    cases = CASES["decode-256xragged"][0]
    steps = {}
    for cache_name in args.caches.split(","):
        q, cache, md, _, _ = build_step(cases, cache_name == "fp8", block_order="ascending")
        steps[cache_name] = DecodeLayers(q, cache, md)
    queries = {name: torch.randn_like(layers.out) for name, layers in steps.items()}
    print(f"{torch.cuda.get_device_name()}, 256 sequences of 100-1,280 keys; qkv alone in us a call, the step in us "
          "a layer", flush=True)

    for round_ in range(args.rounds):
        for name, (lib, attention_lib) in libraries.items():
            hopper_gemm.library = lambda lib=lib: lib
            fp8_decode.library = lambda lib=attention_lib or built_attention: lib
            try:
                line = []
                for cache_name, layers in steps.items():
                    qkv = graph_time_us(lambda layers=layers: hopper_gemm.linear_rope(
                        layers.hidden0, layers.weights[0]["qkv"], layers.ropes[0]), calls=LAYERS)
                    step = graph_time_us(layers.run) / LAYERS
                    query = queries[cache_name]
                    alone = graph_time_us(lambda layers=layers, query=query: triton_attention.decode_attention(
                        query, layers.caches[0], layers.md, HEAD_DIM**-0.5, out=layers.out), calls=LAYERS)
                    line.append(f"{cache_name}: qkv {qkv:6.2f} step {step:6.1f} attention alone {alone:6.1f}")
            finally:
                hopper_gemm.library = lambda: built
                fp8_decode.library = lambda: built_attention
            print(f"round {round_} {name:<44} " + "   ".join(line), flush=True)


if __name__ == "__main__":
    main()
