"""CUDA graphs for decode-only steps.

A decode step launches a few hundred small kernels; on a host whose CPU is slow next to its GPU,
launching them costs more than running them. So at start-up the model's forward pass is captured
once per batch-size bucket (1, 2, 4, 8, then every 16 up to max_num_seqs), reading its inputs from
persistent device buffers. A decode step of n requests then copies its inputs into those buffers,
pads them to the next bucket (padding rows: position 0, slot -1 so nothing is written, sequence
length 0 so nothing is read) and replays the bucket's graph: one launch for the whole model.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from worker.attention.metadata import AttentionMetadata
from worker.input_batch import StepInputs

logger = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    buckets += list(range(16, max_num_seqs, 16))
    return buckets + [max_num_seqs]


class StepBuffers:
    """Persistent device tensors a step's inputs are copied into (graphs read them by address)."""

    def __init__(self, max_tokens: int, max_num_seqs: int, max_blocks_per_req: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_tokens)
        self.positions = zeros(max_tokens)
        self.slot_mapping = zeros(max_tokens)
        self.query_start_loc = zeros(max_num_seqs + 1, dtype=torch.int32)
        self.seq_lens = zeros(max_num_seqs, dtype=torch.int32)
        self.block_tables = zeros(max_num_seqs, max_blocks_per_req, dtype=torch.int32)

    def load(self, step: StepInputs, padded_seqs: int | None = None) -> AttentionMetadata:
        """Copy a step's host arrays in; for a decode graph, pad the batch to `padded_seqs` rows
        on the host first (position 0, slot -1: nothing written, sequence length 0: nothing read)."""
        num_seqs, num_tokens = len(step.req_ids), step.num_tokens
        input_ids, positions, slot_mapping = step.input_ids, step.positions, step.slot_mapping
        query_start_loc, seq_lens = step.query_start_loc, step.seq_lens
        if padded_seqs is not None and padded_seqs > num_seqs:  # decode: one token per row
            pad = padded_seqs - num_seqs
            input_ids = np.concatenate([input_ids, np.zeros(pad, dtype=np.int64)])
            positions = np.concatenate([positions, np.zeros(pad, dtype=np.int64)])
            slot_mapping = np.concatenate([slot_mapping, np.full(pad, -1, dtype=np.int64)])
            query_start_loc = np.arange(padded_seqs + 1, dtype=np.int64)
            seq_lens = np.concatenate([seq_lens, np.zeros(pad, dtype=np.int64)])
            num_seqs = num_tokens = padded_seqs
        for buffer, array in ((self.input_ids, input_ids), (self.positions, positions),
                              (self.slot_mapping, slot_mapping), (self.query_start_loc, query_start_loc),
                              (self.seq_lens, seq_lens)):
            buffer[: len(array)].copy_(torch.from_numpy(array), non_blocking=True)
        rows, columns = step.block_table.shape
        self.block_tables[:rows, :columns].copy_(torch.from_numpy(step.block_table), non_blocking=True)
        return self.metadata(num_tokens, num_seqs, step.max_query_len, step.max_seq_len)

    def metadata(self, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs],
            block_tables=self.block_tables[:num_seqs],
            slot_mapping=self.slot_mapping[:num_tokens],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )


class DecodeGraphs:
    """One captured forward per bucket; `run(n)` replays the smallest bucket that holds n."""

    def __init__(self, forward: Callable[..., torch.Tensor], buffers: StepBuffers, max_num_seqs: int,
                 max_model_len: int) -> None:
        self.buffers = buffers
        self.buckets = decode_buckets(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        # Largest first, so the smaller graphs reuse its memory pool.
        for bucket in reversed(self.buckets):
            # Every row padding: the captures touch no real cache slot.
            buffers.slot_mapping[:bucket] = -1
            buffers.seq_lens[:bucket] = 0
            buffers.query_start_loc[: bucket + 1] = torch.arange(bucket + 1, device=buffers.seq_lens.device)
            metadata = buffers.metadata(bucket, bucket, max_query_len=1, max_seq_len=max_model_len)
            args = (buffers.input_ids[:bucket], buffers.positions[:bucket], metadata)
            forward(*args)  # warm-up: compiles kernels, settles the allocator
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = forward(*args)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.buckets)

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def run(self, num_seqs: int, bucket: int) -> torch.Tensor:
        """Replay a bucket whose inputs StepBuffers.load(step, bucket) has put in place."""
        self.graphs[bucket].replay()
        return self.outputs[bucket][:num_seqs]
