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
from benchmarks.tune_attention import CASES, HEAD_DIM, build_step
from minivllm.protocol.config import cache_root
from minivllm.worker import hopper_gemm
from minivllm.worker.attention import fp8_decode, triton_attention
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

# fp8_decode.cu, by name: "write back" has the warp that attended a sequence's last block store that
# block's values and scales back from its stage, whole (the same bytes: the output is unchanged), as
# a decode kernel would that wrote the step's values and scales itself, a whole block at a time.
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
# "rows": values read as if stored like keys, a head's block [slot][dim] (what "values as one row"
# writes): the ring's copies swizzle each slot's 16-byte chunks (chunk c of slot s at c ^ 2 (s / 4),
# so that the 8 lanes of a quarter-warp hit 8 bank groups), a lane loads its 4 slots' 16 bytes of
# dims 16 g .. 16 g + 15 (lane group g takes those dims instead of g, g + 8, g + 16, ...) and
# transposes them 4 x 4 bytes with byte permutes into words of one dim's 4 slots, and the merge puts
# each accumulator row at its dim. Reading the cache as it is (transposed), the output is wrong; this
# times what the reads and permutes cost.
VALUE_COPY = "    cp_async_16(stage + kKeyBytes + chunk * 16, values + chunk * 16);  // a head's values: one 2 KiB run\n"
VALUE_READ = """  const uint8_t* values = stage + kKeyBytes + g * kBlockSize + 4 * t;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    tile.value[2 * j] = *reinterpret_cast<const uint32_t*>(values + 16 * kBlockSize * j);
    tile.value[2 * j + 1] = *reinterpret_cast<const uint32_t*>(values + 16 * kBlockSize * j + 8 * kBlockSize);
  }
"""
ROW_READ = """  uint4 rows[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    rows[i] = *reinterpret_cast<const uint4*>(stage + kKeyBytes + (4 * t + i) * kHeadDim + ((g ^ (2 * t)) << 4));
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint32_t a = word(rows[0], w), b = word(rows[1], w), c = word(rows[2], w), d = word(rows[3], w);
    const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
    const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
    tile.value[4 * w] = __byte_perm(ab_lo, cd_lo, 0x5410);
    tile.value[4 * w + 1] = __byte_perm(ab_lo, cd_lo, 0x7632);
    tile.value[4 * w + 2] = __byte_perm(ab_hi, cd_hi, 0x5410);
    tile.value[4 * w + 3] = __byte_perm(ab_hi, cd_hi, 0x7632);
  }
"""
ATTENTION_VARIANTS: dict[str, list[tuple[str, str]]] = {
    "as built": [],
    "write back": [(LOOP_END, LOOP_END + WRITE_BACK)],
    "rows": [(VALUE_COPY, "    cp_async_16(stage + kKeyBytes + (chunk & ~7) * 16 + (((chunk & 7) ^ ((chunk >> 4) & 6)) << 4), "
                          "values + chunk * 16);\n"),
             (VALUE_READ, ROW_READ)] + [
        (f"shared_acc[warp][2 * t{q}][16 * j + g{e}] = st.acc[j][{r}]",
         f"shared_acc[warp][2 * t{q}][16 * g + 2 * j{e and ' + 1'}] = st.acc[j][{r}]")
        for q, e, r in (("", "", 0), (" + 1", "", 1), ("", " + 8", 2), (" + 1", " + 8", 3))],
}


def build(text: str, name: str = "hopper_gemm.cu", load=hopper_gemm.load_library) -> ctypes.CDLL:
    """A kernel source's text (hopper_gemm.cu's, or `name`'s) built once per machine beside
    hopper_gemm.cu's header, and loaded with `load`."""
    directory = os.path.join(str(cache_root()), "kernels", "rope-epilogue-probe",
                             hashlib.sha1(text.encode()).hexdigest()[:12])
    target = os.path.join(directory, name.replace(".cu", ".so"))
    if not os.path.exists(target):
        os.makedirs(directory, exist_ok=True)
        shutil.copy(os.path.join(os.path.dirname(hopper_gemm.SOURCE), "hopper_ptx.cuh"), directory)
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
        compile_library(find_nvcc(), os.path.join(directory, name), target + ".tmp")
        os.replace(target + ".tmp", target)
    return load(target)


def variant_text(edits: list[tuple[str, str]], source: str = hopper_gemm.SOURCE) -> str:
    with open(source) as f:
        text = f.read()
    for old, new in edits:
        assert text.count(old) == 1, f"{os.path.basename(source)} changed; the probe's edit no longer applies: {old!r}"
        text = text.replace(old, new)
    return text


def variant_libraries(spec: str) -> tuple[ctypes.CDLL, ctypes.CDLL | None]:
    """'GEMM variant[+GEMM variant...][@attention variant]' -> (hopper_gemm, fp8_decode or None: the engine's)."""
    gemm, _, attention = spec.partition("@")
    gemm_lib = build(variant_text([edit for name in gemm.split("+") for edit in VARIANTS[name]]))
    if not attention or attention == "as built":
        return gemm_lib, None
    return gemm_lib, build(variant_text(ATTENTION_VARIANTS[attention], fp8_decode.SOURCE), "fp8_decode.cu",
                           fp8_decode.load_library)


def rows_cache(cache: torch.Tensor, layout) -> torch.Tensor:
    """A copy of an FP8 cache with each head's block of values stored [slot][dim], as "rows" reads them."""
    num_blocks, data = cache.shape[1], layout.block_size * layout.num_kv_heads * layout.head_dim
    out = cache.clone()
    values = cache[1, :, :data].view(num_blocks, layout.num_kv_heads, layout.head_dim, layout.block_size)
    out[1, :, :data].view(num_blocks, layout.num_kv_heads, layout.block_size, layout.head_dim).copy_(
        values.transpose(2, 3))
    return out


def check_rows(rows_lib: ctypes.CDLL) -> None:
    """The "rows" kernel over the cache rewritten [slot][dim] against the engine's over the cache as it is."""
    q, cache, md, _, _ = build_step(CASES["decode-256xragged"][0], True, block_order="ascending")
    expected, got = torch.empty_like(q), torch.empty_like(q)
    triton_attention.decode_attention(q, cache, md, HEAD_DIM**-0.5, out=expected)
    built = fp8_decode.library()
    fp8_decode.library = lambda: rows_lib
    try:
        triton_attention.decode_attention(q, rows_cache(cache, md.layout(cache)), md, HEAD_DIM**-0.5, out=got)
    finally:
        fp8_decode.library = lambda: built
    print(f"  rows over a [slot][dim] cache: bit-equal to the engine's kernel {torch.equal(expected, got)}, "
          f"max |diff| {(expected.float() - got.float()).abs().max().item():.3g}", flush=True)


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
    for spec, (_, attention_lib) in libraries.items():
        if spec.endswith("@rows"):
            check_rows(attention_lib)
            break

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
