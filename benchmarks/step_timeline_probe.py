"""Where the FP8 decode kernel's time goes inside a decode step: a timeline of its CTAs.

    python3 benchmarks/step_timeline_probe.py [--context N | --ragged] [options]   # on the device machine

Builds fp8_decode.cu and hopper_gemm.cu with timestamps (%globaltimer) written by every CTA of the
decode kernel (start, the return of its griddepcontrol.wait, end, SM), and by the qkv GEMM's
(linear_rope) and the o projection's CTAs (start, the return of their wait, and the qkv CTAs' end).
It replays two CUDA graphs of 28 layers and reads what the last layer wrote:
- `step`: a decode step's layers (add + RMSNorm, linear_rope, attention, o, add + RMSNorm, gate|up
  with SiLU-and-mul, down), each layer with its own cache;
- `chain`: the decode kernels alone, back to back.
It prints, in us from the moment the kernel's first CTA got past its wait: when its CTAs started,
how many ran at a time (with --full-timeline, 1 us by 1 us), how long at least 90% of the 528 slots
were busy, the tail after, and when the GEMMs' CTAs started and ended.

The options each test one explanation of why the kernel's first wave runs ~4 us longer in a step
than in a chain (benchmarks/results/2026-11-28-qkv-overlap/ has the H100's answers):
- --no-wait: a bound, the decode kernel not waiting for the GEMM (its output is wrong);
- --shared-weights, --shared-cache: the step touching less memory (TLB reach);
- --prefetch N [--prefetch-at qkv|mlp]: the first wave's first N blocks pulled into L2 beforehand;
- --stagger N [--stagger-by head|seq]: the first wave's head h (or the CTAs of the sequence at
  position y of the order, by y % 8) spinning h x N ns after its wait, out of step with the
  sequence's other heads. This one paid, and fp8_decode.cu now does it itself
  (MINIVLLM_FP8_DECODE_STAGGER=0 turns that off, as these figures need before --stagger).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.graph_timing import graph_time_us
from benchmarks.kernel_variants import built_text, edited_text
from benchmarks.qkv_attention_overlap_probe import LAYERS, DecodeLayers
from benchmarks.tune_attention import CASES, HEAD_DIM, HEADS, KV_HEADS, build_step
from minivllm.worker import hopper_gemm
from minivllm.worker.attention import fp8_decode, triton_attention

NOW = """
__device__ __forceinline__ unsigned long long timeline_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
"""
BUILD_TAG = "step-timeline-probe"  # (the builds' folder under $MINIVLLM_CACHE/kernels)
MAX_ATTENTION_CTAS = 4096
MAX_GEMM_CTAS = 512

# (what the source has, what the timed build has instead): each must occur once.
ATTENTION_EDITS = [
    ("#include <cstdio>\n",
     "#include <cstdio>\n" + NOW + f"__device__ unsigned long long g_timeline[4 * {MAX_ATTENTION_CTAS}];\n"
     'extern "C" int minivllm_read_timeline(void* dst) {\n'
     "  return int(cudaMemcpyFromSymbol(dst, g_timeline, sizeof(g_timeline)));\n}\n"),
    ('  asm volatile("griddepcontrol.launch_dependents;\\n" ::: "memory");\n  const int kv_head = blockIdx.x;\n',
     '  asm volatile("griddepcontrol.launch_dependents;\\n" ::: "memory");\n'
     "  const unsigned long long t_start = timeline_now();\n  const int kv_head = blockIdx.x;\n"),
    ("  wait_for_previous_kernel();\n  for (; staged",
     "  wait_for_previous_kernel();\n  const unsigned long long t_wait = timeline_now();\n  for (; staged"),
    ("        p.partial_sum[state] = sum;\n      }\n    }\n  }\n}\n",
     "        p.partial_sum[state] = sum;\n      }\n    }\n  }\n"
     "  if (threadIdx.x == 0) {\n"
     "    const int id = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);\n"
     "    unsigned sm;\n    asm(\"mov.u32 %0, %%smid;\" : \"=r\"(sm));\n"
     f"    if (id < {MAX_ATTENTION_CTAS}) {{\n"
     "      g_timeline[4 * id] = t_start;\n      g_timeline[4 * id + 1] = t_wait;\n"
     "      g_timeline[4 * id + 2] = timeline_now();\n      g_timeline[4 * id + 3] = sm;\n    }\n  }\n}\n"),
]
# The qkv GEMM (ROPE) and the o projection (K = 2,048: 32 chunks, neither gated nor ROPE).
GEMM_TIMED = "(ROPE || (!GATED && p.num_chunks == 32)) && blockIdx.x < " + str(MAX_GEMM_CTAS)
GEMM_EDITS = [
    ('#include "hopper_ptx.cuh"\n',
     '#include "hopper_ptx.cuh"\n' + NOW + f"__device__ unsigned long long g_timeline[2 * 3 * {MAX_GEMM_CTAS}];\n"
     'extern "C" int minivllm_read_timeline(void* dst) {\n'
     "  return int(cudaMemcpyFromSymbol(dst, g_timeline, sizeof(g_timeline)));\n}\n"),
    ('  asm volatile("griddepcontrol.launch_dependents;\\n" ::: "memory");\n',
     '  asm volatile("griddepcontrol.launch_dependents;\\n" ::: "memory");\n'
     f"  if (threadIdx.x == 0 && {GEMM_TIMED})\n"
     f"    g_timeline[(ROPE ? 0 : 3 * {MAX_GEMM_CTAS}) + 3 * blockIdx.x] = timeline_now();\n"),
    ('      asm volatile("griddepcontrol.wait;\\n" ::: "memory");\n',
     '      asm volatile("griddepcontrol.wait;\\n" ::: "memory");\n'
     f"      if ({GEMM_TIMED})\n"
     f"        g_timeline[(ROPE ? 0 : 3 * {MAX_GEMM_CTAS}) + 3 * blockIdx.x + 1] = timeline_now();\n"),
    # (a ROPE CTA's producer threads return after their share of the epilogue; thread 0's is the end)
    ("                      reinterpret_cast<const int2*>(smem + L::kSlots), p, rope, row_tile, token_tile * BT);\n"
     "    }\n    return;\n",
     "                      reinterpret_cast<const int2*>(smem + L::kSlots), p, rope, row_tile, token_tile * BT);\n"
     f"      if (threadIdx.x == 0 && blockIdx.x < {MAX_GEMM_CTAS}) g_timeline[3 * blockIdx.x + 2] = timeline_now();\n"
     "    }\n    return;\n"),
]


# --prefetch: a kernel that pulls into L2 what the decode kernel's first wave copies first (each of
# its first CTAs' first `blocks` cache blocks: keys, values and both scales, one bulk prefetch each).
PREFETCH_SOURCE = r"""
#include <cstdint>
#include <cuda_runtime.h>
__device__ __forceinline__ void prefetch_l2(const void* address, int bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(address), "r"(bytes) : "memory");
}
__global__ void prefetch_first_blocks(const uint8_t* key, const uint8_t* value, const uint8_t* key_scale,
                                      const uint8_t* value_scale, const int* block_tables, int64_t table_stride,
                                      const int* seq_lens, const int* seq_order, int num_kv_heads, int num_ctas,
                                      int blocks, int64_t block_bytes, int64_t head_bytes, int64_t scale_head_bytes) {
  for (int w = blockIdx.x * blockDim.x + threadIdx.x; w < num_ctas * blocks; w += gridDim.x * blockDim.x) {
    const int cta = w / blocks, b = w % blocks;
    const int seq = seq_order[cta / num_kv_heads], head = cta % num_kv_heads;
    if (b * 16 >= seq_lens[seq]) continue;
    const int64_t block = block_tables[seq * table_stride + b];
    prefetch_l2(key + block * block_bytes + head * head_bytes, 2048);
    prefetch_l2(value + block * block_bytes + head * head_bytes, 2048);
    prefetch_l2(key_scale + block * block_bytes + head * scale_head_bytes, 32);
    prefetch_l2(value_scale + block * block_bytes + head * scale_head_bytes, 32);
  }
}
extern "C" int minivllm_prefetch_first_blocks(const void* key, const void* value, const void* key_scale,
                                              const void* value_scale, const int* block_tables, int64_t table_stride,
                                              const int* seq_lens, const int* seq_order, int num_kv_heads,
                                              int num_ctas, int blocks, int64_t block_bytes, int64_t head_bytes,
                                              int64_t scale_head_bytes, void* stream) {
  prefetch_first_blocks<<<132, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(key), static_cast<const uint8_t*>(value), static_cast<const uint8_t*>(key_scale),
      static_cast<const uint8_t*>(value_scale), block_tables, table_stride, seq_lens, seq_order, num_kv_heads,
      num_ctas, blocks, block_bytes, head_bytes, scale_head_bytes);
  return int(cudaGetLastError());
}
"""


def prefetch_library() -> ctypes.CDLL:
    lib = built_text(PREFETCH_SOURCE, "prefetch.cu", ctypes.CDLL, BUILD_TAG)
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.minivllm_prefetch_first_blocks.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, i32, i32, i32, i64, i64,
                                                   i64, ptr]
    lib.minivllm_prefetch_first_blocks.restype = i32
    return lib


def timed_build(source: str, edits: list[tuple[str, str]], loader) -> ctypes.CDLL:
    """source with `edits`, built once per machine beside its includes, loaded by `loader`."""
    lib = built_text(edited_text(source, edits), os.path.basename(source), loader, BUILD_TAG)
    lib.minivllm_read_timeline.argtypes = [ctypes.c_void_p]
    lib.minivllm_read_timeline.restype = ctypes.c_int
    return lib


def attention_edits(no_wait: bool, stagger: int, stagger_by: str, num_sms: int) -> list[tuple[str, str]]:
    """ATTENTION_EDITS with --no-wait's and --stagger's changes (a GPU of num_sms multiprocessors)."""
    edits = list(ATTENTION_EDITS)
    if no_wait:
        edits = [(old, new.replace("  wait_for_previous_kernel();\n", "")) for old, new in edits]
    if stagger:
        phase = "blockIdx.x % 8" if stagger_by == "head" else "blockIdx.y % 8"
        spin = ("  {\n    const int cta = blockIdx.x + gridDim.x * blockIdx.y;\n"
                f"    if (cta < {4 * num_sms})\n"
                f"      while (timeline_now() < t_wait + ({phase}) * {stagger}ull) {{}}\n"
                "  }\n")
        edits = [(old, new.replace("t_wait = timeline_now();\n", "t_wait = timeline_now();\n" + spin))
                 for old, new in edits]
    return edits


def read(lib: ctypes.CDLL, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=np.uint64)
    torch.cuda.synchronize()
    assert lib.minivllm_read_timeline(out.ctypes.data) == 0
    return out


def report(name: str, attention: np.ndarray, gemm: np.ndarray | None, num_ctas: int, us_a_layer: float,
           resident: int, full_timeline: bool) -> None:
    """Attention rows [start, wait, end, sm] of the last replay's last layer; gemm its qkv and o rows."""
    rows = attention.reshape(-1, 4)[:num_ctas].astype(np.int64)
    t0 = rows[:, 1].min()
    start, wait, end = ((rows[:, i] - t0) / 1000.0 for i in range(3))
    span = end.max()
    busy = (end - start).sum()
    print(f"{name}: {us_a_layer:.1f} us a layer in the graph; the kernel from its first wait's return to its "
          f"last CTA's end: {span:.1f} us", flush=True)
    steps = np.diff(np.unique(rows[:, :3]))
    print(f"  (globaltimer: smallest step seen {steps.min() if steps.size else 0} ns)", flush=True)
    print(f"  CTAs {num_ctas}, {resident} at a time at most (4 an SM); started before t0: {(start < 0).sum()} "
          f"(first {start.min():.1f}); median life {np.median(end - start):.2f} us; sum of lives / {resident} slots "
          f"{busy / resident:.1f} us", flush=True)
    early = start < 0
    print(f"  the {early.sum()} CTAs that started before t0 got past their waits {wait[early].min():.2f} to "
          f"{wait[early].max():.2f} us", flush=True)
    edges = np.arange(np.floor(start.min()), np.ceil(span) + 1.0, 1.0)
    running = [int(((start < b + 1.0) & (end > b)).sum()) for b in edges[:-1]]
    if full_timeline:
        print("  CTAs running, by us from t0: " + " ".join(f"{int(b)}:{n}" for b, n in zip(edges, running)), flush=True)
    full = [b for b, n in zip(edges, running) if n >= 0.9 * resident]
    if full:
        print(f"  >= 90% of slots busy from {full[0]:.0f} to {full[-1] + 1:.0f} us ({full[-1] + 1 - full[0]:.0f} us), "
              f"then a tail of {span - full[-1] - 1:.1f} us", flush=True)
    if gemm is not None:
        g = gemm.reshape(2, -1, 3).astype(np.int64)
        qkv, o = g[0][g[0][:, 0] > 0], g[1][g[1][:, 0] > 0]
        last_end = rows[:, 2].max()
        print(f"  qkv GEMM's CTAs started {(qkv[:, 0].min() - t0) / 1000:.1f} to {(qkv[:, 0].max() - t0) / 1000:.1f} "
              f"us; their waits returned {(qkv[:, 1].min() - t0) / 1000:.1f} to {(qkv[:, 1].max() - t0) / 1000:.1f}; "
              f"they ended {(qkv[:, 2].min() - t0) / 1000:.1f} to {(qkv[:, 2].max() - t0) / 1000:.1f}",
              flush=True)
        heads = np.arange(qkv.shape[0]) // (qkv.shape[0] // (HEADS + 2 * KV_HEADS))  # CTAs go head by head
        ends = (qkv[:, 2] - t0) / 1000
        kinds = {"q": heads < HEADS, "k": (heads >= HEADS) & (heads < HEADS + KV_HEADS), "v": heads >= HEADS + KV_HEADS}
        print("  qkv GEMM's CTAs ended, by head: " + ", ".join(
            f"{kind} {ends[m].min():.1f} to {ends[m].max():.1f} (median {np.median(ends[m]):.1f})"
            for kind, m in kinds.items()), flush=True)
        print(f"  o projection's CTAs started {(o[:, 0].min() - last_end) / 1000:.1f} to "
              f"{(o[:, 0].max() - last_end) / 1000:.1f} us after the attention's last end; their waits returned "
              f"{(o[:, 1].min() - last_end) / 1000:.1f} to {(o[:, 1].max() - last_end) / 1000:.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--ragged", action="store_true", help="tune_attention's decode-256xragged contexts (100-1,280)")
    parser.add_argument("--full-timeline", action="store_true", help="print how many CTAs ran, 1 us by 1 us")
    parser.add_argument("--no-wait", action="store_true",
                        help="a bound, not a kernel: the decode kernel does not wait for the qkv GEMM (it reads q and "
                             "the newest K/V while they are written; its output is wrong), to time what waiting costs")
    parser.add_argument("--prefetch", type=int, default=0,
                        help="before each layer's qkv GEMM, pull into L2 the first N cache blocks of each of the "
                             "decode kernel's first-wave CTAs (see PREFETCH_SOURCE)")
    parser.add_argument("--prefetch-at", default="qkv", choices=("qkv", "mlp"),
                        help="where: before the qkv GEMM, or before the layer before's gate|up projection")
    parser.add_argument("--stagger", type=int, default=0,
                        help="after its wait, a first-wave CTA of the decode kernel spins (its phase, 0-7, see "
                             "--stagger-by) x N ns before going on: are the first wave's CTAs slower for running in "
                             "step? (run with MINIVLLM_FP8_DECODE_STAGGER=0)")
    parser.add_argument("--stagger-by", default="head", choices=("head", "seq"),
                        help="stagger by KV head (a sequence's 8 CTAs apart), or by the sequence's position in the "
                             "order (its 8 CTAs together, neighbouring sequences apart)")
    parser.add_argument("--gemm-source", default=hopper_gemm.SOURCE,
                        help="the hopper_gemm.cu to time (another tree's copy, to set beside this one's)")
    parser.add_argument("--shared-weights", action="store_true", help="every layer uses layer 0's weights")
    parser.add_argument("--shared-cache", action="store_true", help="every layer reads (and writes) layer 0's cache")
    args = parser.parse_args()
    cases = CASES["decode-256xragged"][0] if args.ragged else [(args.context, 1)] * 256
    q, cache, md, _, _ = build_step(cases, True, block_order="ascending")
    num_tokens, dev = q.shape[0], q.device
    edits = attention_edits(args.no_wait, args.stagger, args.stagger_by,
                            torch.cuda.get_device_properties(0).multi_processor_count)
    attention_lib = timed_build(fp8_decode.SOURCE, edits, fp8_decode.load_library)
    gemm_lib = timed_build(args.gemm_source, GEMM_EDITS, hopper_gemm.load_library)
    fp8_decode.library = lambda: attention_lib
    hopper_gemm.library = lambda: gemm_lib
    layers = DecodeLayers(q, cache, md, args.shared_weights, args.shared_cache)
    out = layers.out

    seq_order = md.longest_first()
    first_wave = min(num_tokens * KV_HEADS, 4 * torch.cuda.get_device_properties(dev).multi_processor_count)
    prefetcher = prefetch_library() if args.prefetch else None

    def prefetch(layer: int) -> None:
        if prefetcher is None or layer >= LAYERS:
            return
        views = layers.layout.split(layers.caches[layer])
        assert views.key.stride(1) == 128 and views.value.stride(1) == 128 and views.key_scale.stride(1) == 1
        rc = prefetcher.minivllm_prefetch_first_blocks(
            views.key.data_ptr(), views.value.data_ptr(), views.key_scale.data_ptr(), views.value_scale.data_ptr(),
            md.block_tables.data_ptr(), md.block_tables.stride(0), md.seq_lens.data_ptr(), seq_order.data_ptr(),
            KV_HEADS, first_wave, args.prefetch, views.key.stride(0), views.key.stride(2),
            views.key_scale.stride(2) * 2, torch.cuda.current_stream().cuda_stream)
        assert rc == 0, rc

    def step() -> None:
        if args.prefetch_at == "mlp":
            prefetch(0)
        layers.run(before_qkv=prefetch if args.prefetch_at == "qkv" else None,
                   before_mlp=(lambda layer: prefetch(layer + 1)) if args.prefetch_at == "mlp" else None)

    def chain() -> None:
        for layer in range(LAYERS):
            triton_attention.decode_attention(q, layers.caches[layer], md, HEAD_DIM**-0.5, out=out)

    num_ctas = num_tokens * KV_HEADS
    resident = 4 * torch.cuda.get_device_properties(dev).multi_processor_count
    shape = "100-1,280" if args.ragged else args.context
    setup = [f"{torch.cuda.get_device_name()} fp8 256 x {shape}", "blocks ascending"]
    setup += ["the decode kernel NOT waiting for the kernel before it"] if args.no_wait else []
    setup += ["one set of weights"] if args.shared_weights else []
    setup += ["one cache"] if args.shared_cache else []
    setup += [f"prefetching {args.prefetch} blocks a first-wave CTA before {args.prefetch_at}"] if args.prefetch else []
    setup += [f"qkv GEMM from {args.gemm_source}"] if args.gemm_source != hopper_gemm.SOURCE else []
    setup += [f"first-wave CTAs staggered by {args.stagger_by}, {args.stagger} ns"] if args.stagger else []
    print(", ".join(setup) + "; us", flush=True)
    for name, fn, with_gemm in (("step", step, True), ("chain", chain, False), ("step", step, True)):
        us = graph_time_us(fn) / LAYERS  # (its last replay's last layer is what the buffers hold)
        report(name, read(attention_lib, 4 * MAX_ATTENTION_CTAS), read(gemm_lib, 6 * MAX_GEMM_CTAS) if with_gemm
               else None, num_ctas, us, resident, args.full_timeline)


if __name__ == "__main__":
    main()
