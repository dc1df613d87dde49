"""How many ways a small decode batch should split its keys (split-KV, flash-decoding): the
decode attention kernel's time per call inside a CUDA graph, as the engine runs it (the merge
kernel included), for batch sizes x context lengths x split counts. GPU only.

    python benchmarks/decode_splits.py [--batches 1,2,4,8,16,32] [--contexts 128,256,512,1024]

Each call is timed as one of 50 in a replayed graph: at a few microseconds a kernel, a loop of
eager launches would time the host instead.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for tests.gpu, benchmarks

from benchmarks.graph_timing import graph_time_us
from minivllm.worker.attention.triton_attention import decode_attention
from tests.gpu.test_triton_attention import make_batch

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16  # Qwen3-0.6B


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--contexts", default="128,256,512,1024")
    parser.add_argument("--splits", default="1,2,4,8,16")
    args = parser.parse_args()
    scale = HEAD_DIM**-0.5
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            q, _, _, cache, metadata = make_batch([(context, 1)] * batch, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                                  torch.bfloat16, 0)
            out = torch.empty_like(q)
            reference = decode_attention(q, cache, metadata, scale, num_splits=1).float()
            cells = []
            for splits in map(int, args.splits.split(",")):
                error = (decode_attention(q, cache, metadata, scale, num_splits=splits).float() - reference).abs().max()
                us = graph_time_us(lambda: decode_attention(q, cache, metadata, scale, out=out, num_splits=splits),
                                   calls=50)
                cells.append(f"{splits}: {us:5.2f}" + ("" if error < 2e-2 else f" (off by {error:.3f})"))
            default = graph_time_us(lambda: decode_attention(q, cache, metadata, scale, out=out), calls=50)
            print(f"batch {batch:3d}, context {context:5d}: us per call by splits  " + "  ".join(cells)
                  + f"  | default {default:5.2f}", flush=True)


if __name__ == "__main__":
    main()
