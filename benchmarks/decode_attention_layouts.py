"""Decode attention (256 sequences x ~700 keys, Qwen3-0.6B heads) under different KV cache layouts
and sizes, to see what limits its bandwidth (GPU only):

  token-major: [num_blocks, block_size, kv_heads, head_dim]  (today's layout)
  head-major:  [num_blocks, kv_heads, block_size, head_dim]  (a block's keys of one head are contiguous)

each in a cache just big enough and in one of `--cache-gib` GiB (blocks scattered over it, as a
serving engine's are), for a few tile shapes.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench

from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.triton_attention import DecodeConfig, decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--cache-gib", type=float, default=2.0)  # x 28 layers in a real engine
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = -(-(args.context + 1) // BLOCK)
    needed = args.batch * blocks_per_seq
    bytes_per_block = 2 * BLOCK * KV_HEADS * HEAD_DIM * 2
    seq_lens = torch.full((args.batch,), args.context + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(args.batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kv_bytes = args.batch * (args.context + 1) * KV_HEADS * HEAD_DIM * 2 * 2
    for cache_blocks in (needed + 8, max(needed + 8, int(args.cache_gib * (1 << 30) // bytes_per_block))):
        tables = torch.randperm(cache_blocks, device="cuda", generator=gen)[:needed].view(args.batch, -1).int()
        md = AttentionMetadata(
            query_start_loc=torch.arange(args.batch + 1, dtype=torch.int32, device="cuda"),
            seq_lens=seq_lens, block_tables=tables, slot_mapping=torch.zeros(args.batch, dtype=torch.long, device="cuda"),
            max_query_len=1, max_seq_len=args.context + 1,
        )
        for layout in ("token-major", "head-major"):
            if layout == "token-major":
                cache = torch.randn(2, cache_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            else:  # the kernel takes strides, so a permuted view of a head-major tensor just works
                cache = torch.randn(2, cache_blocks, KV_HEADS, BLOCK, HEAD_DIM, device="cuda",
                                    dtype=torch.bfloat16).transpose(2, 3)
            results = []
            for bn, warps, stages in itertools.product((16, 32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
                try:
                    t = do_bench(lambda cache=cache, bn=bn, warps=warps, stages=stages: decode_attention(
                        q, cache, md, 0.088, config=DecodeConfig(bn, warps, stages), num_splits=1),
                                 warmup=5, rep=40)
                except Exception:  # out of shared memory etc.
                    continue
                results.append((t, (bn, warps, stages)))
            results.sort()
            best = ", ".join(f"{t * 1000:.0f} us {c} {kv_bytes / t / 1e6:.0f} GB/s" for t, c in results[:3])
            print(f"{layout:11s} cache {cache_blocks * bytes_per_block / (1 << 30):6.2f} GiB: {best}", flush=True)
            del cache
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
