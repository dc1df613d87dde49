"""Time the paged attention kernel's tile shapes (GPU only) on prefill and decode batches, plain and
FP8 caches, next to PyTorch's flash attention (SDPA on contiguous K/V) as a yardstick.

    python benchmarks/tune_attention.py [--cases prefill-32k,decode-256x700,...] [--fp8] [--top 4]
        [--baseline OLD/triton_attention.py]

Prefill cases report TFLOP/s (causal attention: 2 * 2 * visible (query, key) pairs * head_dim *
heads); decode cases report TB/s of cache read (K and V of every live token, scales included).
"prefill-32k" is one 32,768-token prompt run as the engine runs it with a budget of 8192: four
chunks, each over the cached prefix of the ones before. Prefill steps carry empty sequences up to
--graph-seqs, as a mixed CUDA graph's bucket does (a step of a few sequences up to FEW_SEQS + 1,
as its few-sequence graph does): the kernel is then compiled as the engine runs it. --baseline
times another version of triton_attention.py (a saved copy) on the same batches with its own
default shapes. Where the Hopper CUDA kernel (hopper_prefill.py) takes a prefill step, the default
is that kernel and Triton's default is timed after it; --block-order lays each sequence's cache
blocks out scattered at random (the default), ascending (as a fresh engine hands them out),
descending (as a recycled pool does) or shuffled within each 128-key tile.

Time steps of a few hundred microseconds or less with --cudagraph: timed eagerly, each call's host
work (the Python around the launch, Triton's launcher) can take longer than its kernels, and the
figure is then the host's (a 16,384-token step of short prompts read 198-278 us eagerly on three
H100s, 194 us in a graph).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for tests.gpu

from minivllm.worker.attention import hopper_prefill, triton_attention
from minivllm.worker.attention.kv_cache import KVCacheLayout
from minivllm.worker.attention.metadata import FEW_SEQS, step_splits_decodes
from minivllm.worker.attention.triton_attention import (
    DecodeConfig,
    PrefillConfig,
    store_kv,
)
from tests.gpu.test_triton_attention import BLOCK_ORDERS, make_batch

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16  # Qwen3-0.6B


def _ragged_prompts(budget: int, low: int, high: int, first: tuple[tuple[int, int], ...] = ()) -> list[tuple[int, int]]:
    """Whole prompts of low..high tokens (uniform, seed 0) filling a step of `budget` tokens, the
    last one cut to fit, as the scheduler packs fresh requests (after `first`, the running ones)."""
    prompts = list(first)
    left = budget - sum(n for _, n in prompts)
    for n in np.random.default_rng(0).integers(low, high + 1, budget):
        prompts.append((0, min(int(n), left)))
        left -= prompts[-1][1]
        if not left:
            return prompts
    return prompts


# name -> the steps it takes, each a list of (cached context, tokens this step) per sequence
CASES = {
    "prefill-1x2048": [[(0, 2048)]],
    "prefill-1x4096": [[(0, 4096)]],
    "prefill-1x8192": [[(0, 8192)]],
    "prefill-32k": [[(c, 8192)] for c in (0, 8192, 16384, 24576)],
    # its chunks after the first, one at a time: each reads the cached prefix before it
    "prefill-8192-after-8k": [[(8192, 8192)]],
    "prefill-8192-after-16k": [[(16384, 8192)]],
    "prefill-8192-after-24k": [[(24576, 8192)]],
    "prefill-1x16384": [[(0, 16384)]],
    # short prompts, as a first token at batch 1 (or a few) runs them
    "prefill-1x128": [[(0, 128)]],
    "prefill-1x512": [[(0, 512)]],
    "prefill-1x1024": [[(0, 1024)]],
    "prefill-8x128": [[(0, 128)] * 8],
    # a long prompt's last chunk, short: it reads the whole cached prefix
    "prefill-128-after-16k": [[(16384, 128)]],
    "prefill-128-after-4k": [[(4096, 128)]],
    "prefill-128-after-2k": [[(2048, 128)]],
    "prefill-256-after-32k": [[(32768, 256)]],
    # a prefill step of the 256-request workload: a full budget of prompts of its mean length
    "prefill-8192x562": [[(0, 562)] * 14 + [(0, 324)]],
    # ... and one at the LLM class's budget on an H100 (16,384), prompts of 100-1,024 tokens
    "prefill-16384xragged": [_ragged_prompts(16384, 100, 1024)],
    # ... as its prompt phase runs them: the running requests' decodes, the chunk after the one
    # the last step cut (an FP8 cache's only cached chunk), then fresh prompts
    "prefill-16384-after-chunk": [_ragged_prompts(16384, 100, 1024, ((700, 1),) * 58 + ((600, 450),))],
    # ... and of mid-length prompts (under the Hopper kernel's 8,192-token floor: these stay on Triton)
    "prefill-4x4096": [[(0, 4096)] * 4],
    "decode-256x700": [[(700, 1)] * 256],
    # the 256-request workload's decode steps: contexts from 100 to 1280 tokens, in arrival order
    "decode-256xragged": [[(int(n), 1) for n in np.random.default_rng(0).integers(100, 1280, 256)]],
    # nano-vllm's workload (outputs of 100-1,024 tokens) mid-run and late: the sequences still running
    # at its 450th and 750th decode step, each its prompt (100-1,024 tokens) plus that many
    "decode-170xnano450": [[(int(n) + 450, 1) for n in np.random.default_rng(1).integers(100, 1025, 170)]],
    "decode-80xnano750": [[(int(n) + 750, 1) for n in np.random.default_rng(2).integers(100, 1025, 80)]],
    # ... and on the way there and after it (about 120, 50 and 24 running at its 620th, 850th and 950th step)
    "decode-120xnano620": [[(int(n) + 620, 1) for n in np.random.default_rng(3).integers(100, 1025, 120)]],
    "decode-50xnano850": [[(int(n) + 850, 1) for n in np.random.default_rng(4).integers(100, 1025, 50)]],
    "decode-24xnano950": [[(int(n) + 950, 1) for n in np.random.default_rng(5).integers(100, 1025, 24)]],
    "decode-32x4096": [[(4096, 1)] * 32],
    "decode-4x16384": [[(16384, 1)] * 4],
}
PREFILL_CONFIGS = [PrefillConfig(m, n, w, st, r) for m, n, w, st, r in itertools.product(
    (64, 128), (32, 64, 128), (4, 8), (2, 3, 4), (None, 128)) if not (r and w == 4)]
# The decode kernel's (block_n, num_warps, num_stages).
DECODE_CONFIGS = [DecodeConfig(n, w, st) for n, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]


def causal_pairs(context: int, query: int) -> int:
    """(query, key) pairs a chunk of `query` tokens after `context` cached ones attends to."""
    return query * context + query * (query + 1) // 2


def build_step(cases, fp8: bool, graph_seqs: int = 0, block_order: str = "scattered", block_size: int = BLOCK_SIZE):
    """A step of `cases`, padded with empty sequences as the engine's graph for it would be (a mixed
    graph's graph_seqs, or a few-sequence graph's FEW_SEQS + 1, without the decode kernel; graph_seqs
    0: no padding, as an eager step)."""
    num_real, max_query_len = len(cases), max(n for _, n in cases)
    few = not step_splits_decodes(num_real, sum(n for _, n in cases), max_query_len)
    pad_to = 0 if not graph_seqs or max_query_len == 1 else FEW_SEQS + 1 if few else graph_seqs
    cases = cases + [(0, 0)] * max(0, pad_to - num_real)
    q, k, v, plain_cache, md = make_batch(cases, HEADS, KV_HEADS, HEAD_DIM, block_size, torch.bfloat16, seed=0,
                                          block_order=block_order)
    if len(cases) > num_real:  # the sequences before the padding, as a graph's buffers say
        md = dataclasses.replace(md, num_active_seqs=torch.tensor([num_real], dtype=torch.int32, device="cuda"))
    md = dataclasses.replace(md, split_decodes=not few)
    if not fp8:
        store_kv(k, v, plain_cache, md.slot_mapping)
        return q, plain_cache, md, k, v
    layout = KVCacheLayout(block_size, KV_HEADS, HEAD_DIM, torch.bfloat16, fp8=True)
    cache = layout.allocate(plain_cache.shape[1], q.device)
    num_slots = plain_cache.shape[1] * block_size
    every_slot = torch.arange(num_slots, device=q.device)
    flat = plain_cache.view(2, num_slots, KV_HEADS, HEAD_DIM)
    store_kv(flat[0], flat[1], cache, every_slot, layout)  # the same K/V, quantized
    store_kv(k, v, cache, md.slot_mapping, layout)
    return q, cache, dataclasses.replace(md, kv_layout=layout), k, v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="prefill-1x8192,prefill-32k,decode-256x700")
    parser.add_argument("--fp8", action="store_true", help="an FP8 cache (kv_cache_dtype='fp8')")
    parser.add_argument("--top", type=int, default=4)
    parser.add_argument("--baseline", help="another triton_attention.py to time beside this one")
    parser.add_argument("--no-sweep", action="store_true", help="time the default shapes only")
    parser.add_argument("--cache-only", action="store_true",
                        help="prefill reads every key from the cache (not a chunk's own from the step's k and v)")
    parser.add_argument("--fresh-sweep", action="store_true",
                        help="with --fp8, on a large prefill step: sweep the shape of the plain kernel's launch that "
                             "takes the sequences without a cached context (PREFILL_FP8_FRESH), the rest at the default")
    parser.add_argument("--configs", help="sweep these shapes only, ';'-separated, each the config's fields "
                                          "comma-separated (none for None), e.g. '128,64,8,3,none;64,64,4,3,none'")
    parser.add_argument("--graph-seqs", type=int, default=257,
                        help="pad prefill steps with empty sequences to this many, as the engine's CUDA graphs do "
                             "(max_num_seqs + 1); 0: no padding")
    parser.add_argument("--splits", type=int, help="prefill: the most programs sharing a context (default: the "
                                                    "engine's rule, metadata.step_splits_contexts)")
    parser.add_argument("--decode-splits", type=int,
                        help="decode: split each sequence's keys this many ways (default: the engine's rule, "
                             "triton_attention.num_kv_splits)")
    parser.add_argument("--block-order", default="scattered", choices=BLOCK_ORDERS,
                        help="how each sequence's cache blocks lie: scattered at random (as after a while of serving), "
                             "consecutive ids ascending (a fresh engine) or descending (a recycled pool), or shuffled "
                             "within each 128-key tile")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="tokens per cache block")
    parser.add_argument("--cudagraph", action="store_true",
                        help="time each shape replayed in a CUDA graph, as the engine runs it (for short steps, "
                             "whose kernels take a few microseconds: no launch overhead in the figure)")
    args = parser.parse_args()
    bench = (lambda fn: do_bench_cudagraph(fn, rep=50, return_mode="median")) if args.cudagraph else \
        (lambda fn: do_bench(fn, warmup=10, rep=50, return_mode="median"))
    baseline = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_attention", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    for name in args.cases.split(","):
        steps = [build_step(cases, args.fp8, args.graph_seqs, args.block_order, args.block_size) for cases in CASES[name]]
        decode = steps[0][2].max_query_len == 1
        layout = steps[0][2].layout(steps[0][1])
        if decode:
            live = sum(c + 1 for c, _ in CASES[name][0])
            work, unit = live * KV_HEADS * 2 * (layout.block_bytes // (args.block_size * KV_HEADS)) / 1e12, "TB/s"
        else:
            pairs = sum(causal_pairs(c, n) for cases in CASES[name] for c, n in cases)
            work, unit = 4 * pairs * HEAD_DIM * HEADS / 1e12, "TFLOP/s"

        def run(tiles, attention=triton_attention):  # (attention: this tree's module, or --baseline's)
            for q, cache, md, k, v in steps:
                if decode:
                    attention.decode_attention(q, cache, md, HEAD_DIM**-0.5, config=tiles,
                                               num_splits=args.decode_splits)
                else:  # as the model calls it: the chunk's own keys from k and v, unless --cache-only
                    fresh = {} if args.cache_only else dict(key=k, value=v)
                    attention.paged_attention(q, cache, md, HEAD_DIM**-0.5, config=tiles, num_splits=args.splits,
                                              **fresh)

        results = []
        sweep = DECODE_CONFIGS if decode else PREFILL_CONFIGS
        if args.configs:
            kind = DecodeConfig if decode else PrefillConfig
            sweep = [kind(*[None if v == "none" else int(v) for v in c.split(",")]) for c in args.configs.split(";")]
        fresh_default = triton_attention.PREFILL_FP8_FRESH
        for tiles in [] if args.no_sweep else sweep:
            try:
                if args.fresh_sweep:  # the shape of the launch that takes an FP8 step's fresh prompts
                    triton_attention.PREFILL_FP8_FRESH = tiles
                    ms = bench(lambda: run(None))
                else:
                    ms = bench(lambda: run(tiles))
            except Exception as exc:  # out of shared memory etc.
                print(f"  {tiles}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            results.append((ms, tiles))
        triton_attention.PREFILL_FP8_FRESH = fresh_default
        results.sort()
        default_ms = bench(lambda: run(None))
        best = "\n    ".join(f"{tuple(t)} {ms * 1000:.0f} us = {work / ms * 1000:.2f} {unit}" for ms, t in results[: args.top])
        print(f"{name}{' fp8' if args.fp8 else ''}: default {default_ms * 1000:.0f} us = "
              f"{work / default_ms * 1000:.2f} {unit}; best {best}")
        if not decode and hopper_prefill.supports(steps[0][0], layout, steps[0][2]):
            hopper_prefill.ENABLED = False  # the same step on the Triton kernel
            ms = bench(lambda: run(None))
            hopper_prefill.ENABLED = True
            print(f"  (that was the Hopper kernel) Triton's default: {ms * 1000:.0f} us = {work / ms * 1000:.2f} {unit}")
        if decode:  # the default shape without running the longest sequences first
            in_order = triton_attention.decode_config(len(CASES[name][0]), args.fp8)._replace(longest_first=False)
            ms = bench(lambda: run(in_order))
            print(f"  default, sequences in order: {ms * 1000:.0f} us = {work / ms * 1000:.2f} {unit}")
        if baseline is not None:
            ms = bench(lambda: run(None, baseline))
            print(f"  baseline {args.baseline}: {ms * 1000:.0f} us = {work / ms * 1000:.2f} {unit}")
        if not decode and len(CASES[name][0]) == 1:  # one prompt: SDPA runs it whole
            total = sum(CASES[name][-1][0])
            qq = torch.randn(1, HEADS, total, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            kk = torch.randn(1, HEADS, total, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            vv = torch.randn(1, HEADS, total, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            ms = do_bench(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True), warmup=10, rep=50,
                          return_mode="median")
            sdpa_work = 4 * causal_pairs(0, total) * HEAD_DIM * HEADS / 1e12
            print(f"  torch SDPA (flash, contiguous, whole {total}-token prompt): {ms * 1000:.0f} us = "
                  f"{sdpa_work / ms * 1000:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
