"""CUDA graphs for every step: decode-only steps and steps with prefill chunks.

A forward pass launches over a thousand small kernels; on a host whose CPU is slow next to its
GPU, launching them costs far more than running them (an eager step of this model takes ~35 ms
of CPU whatever its size). So at start-up the forward pass is captured once per bucket, reading
its inputs from persistent device buffers, and a step copies its inputs into those buffers, pads
them to its bucket and replays one graph:

  decode buckets: n requests of one token each, n in 1, 2, 4, 8, 16, 32, ... max_num_seqs;
  mixed buckets:  up to T tokens of up to max_num_seqs requests, T in 64, 128, 256, ... up to
                  max_num_batched_tokens (attention's grid depends on both counts, so both are
                  padded: the sequence count always to max_num_seqs + 1);
  few buckets:    steps with prefill chunks of at most FEW_SEQS requests, up to T tokens, T in
                  the mixed sizes up to FEW_SEQS_MAX_TOKENS (a first token at low load): padded to
                  FEW_SEQS + 1 sequences, and one attention kernel takes them all, decodes too
                  (metadata.split_decodes). In a mixed graph the decode kernel's launch over 257
                  mostly empty sequences took 2.8 us a layer, ~5% of a 128-token prompt's forward.
                  Up to FEW_SEQS_SPLIT_MAX_TOKENS tokens their prefill kernel shares each long
                  context out among several programs (metadata.step_splits_contexts);
  verify buckets: with speculative decoding, n requests of up to 1 + k tokens each (k drafts),
                  n in the decode sizes up to the batch size speculation runs at: n * (1 + k)
                  tokens and n + 1 sequences. Without them a batch-1 verify step of 1 + k tokens
                  would replay the smallest mixed graph, padded to max_num_seqs + 1 sequences.

Sampling graphs: a decode bucket also gets a second, small graph that runs the LM head over the
forward graph's hidden states and samples every row with the fused sampler's two kernels
(worker/fused_sampling.py), reading the rows' temperatures and Philox seeds from persistent buffers
and writing their tokens to another (StepBuffers.sampled). A decode step whose rows all sample
plainly (greedy or temperature only; no top-k/top-p/min-p, logits processors or logprobs) replays
it after the forward: at batch 1 that saves ~0.3 ms of host work per token (the LM head's launch,
three small copies and two Triton launches), which otherwise competes with the GPU's ~1.1 ms.

Padding is made harmless on the host: padded tokens have position 0 and slot -1 (nothing is
written to the cache) and belong to sequences of length 0 (nothing is read, the output is 0).
Decode padding gives each padded row a sequence of its own; mixed padding puts the padded tokens
into one extra sequence after the step's and leaves the padded sequences after it empty (the
metadata's num_active_seqs counts the ones before: the prefill kernel's grid spans every
sequence, and its programs for the empty ones exit at once).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from minivllm.protocol.config import EngineConfig
from minivllm.worker import output_rows
from minivllm.worker.attention.kv_cache import KVCacheLayout
from minivllm.worker.attention.metadata import (
    DECODE_LONG_CONTEXT,
    DECODE_LONG_CONTEXT_MAX_SEQS,
    FEW_SEQS,
    FEW_SEQS_MAX_TOKENS,
    AttentionMetadata,
    step_splits_decodes,
)
from minivllm.worker.input_batch import StepInputs
from minivllm.worker.step_buffers import StepBuffers

__all__ = ["StepBuffers", "StepGraphs", "run_forward", "max_step_tokens"]

logger = logging.getLogger(__name__)

# (input ids, positions, metadata[, output_rows=...]) -> hidden states (a pipeline stage's: and residual)
Forward = Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
# Hidden states [n, hidden] -> nothing: samples the n rows into StepBuffers.sampled[:n].
Sample = Callable[[torch.Tensor], None]


def decode_buckets(max_num_seqs: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    buckets += list(range(16, max_num_seqs, 16))
    return buckets + [max_num_seqs]


def mixed_buckets(max_num_batched_tokens: int) -> list[int]:
    # From 64: a short prompt's first token waits for its step's forward, which takes ~1.3 ms in
    # a 64-token graph against ~1.7 ms in a 256-token one (Qwen3-0.6B shape, H100).
    buckets, size = [], 64
    while size < max_num_batched_tokens:
        buckets.append(size)
        size *= 2
    return buckets + [max_num_batched_tokens]


def max_step_tokens(config: EngineConfig) -> int:
    """How many tokens a step's persistent inputs hold: a step schedules at most
    max_num_batched_tokens, and a decode graph pads to as many rows as max_num_seqs."""
    return max(config.max_num_batched_tokens, config.max_num_seqs)


class StepGraphs:
    """One captured forward per bucket; `run(step)` replays the smallest bucket that holds it."""

    def __init__(self, forward: Forward, buffers: StepBuffers, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, verify_query_len: int = 0, max_verify_seqs: int = 0,
                 sample: Sample | None = None, eager_prefill: Callable[[StepInputs], bool] | None = None) -> None:
        """eager_prefill(step): whether a step with prompt tokens runs eagerly although a graph
        would hold it (one whose attention has a faster kernel that graphs do not capture:
        StepBuffers.takes_hopper_prefill)."""
        self.buffers = buffers
        self.eager_prefill = eager_prefill
        self.max_num_seqs = max_num_seqs
        self.decode_buckets = decode_buckets(max_num_seqs)
        self.mixed_buckets = mixed_buckets(max_num_batched_tokens)
        # Verify buckets (speculative decoding): only where the smallest mixed bucket is larger
        # (it is at most max_num_batched_tokens, so they fit the buffers too).
        self.verify_query_len = verify_query_len
        self.verify_buckets = [] if verify_query_len < 2 else [
            n for n in decode_buckets(min(max_verify_seqs, max_num_seqs)) if n * verify_query_len < self.mixed_buckets[0]]
        self.few_seqs = min(FEW_SEQS, max_num_seqs)
        self.few_buckets = [t for t in self.mixed_buckets if t <= FEW_SEQS_MAX_TOKENS]
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.sample_graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        # With max_num_seqs <= FEW_SEQS every step with prompt tokens that a few bucket holds takes
        # it: no mixed graph of those sizes would ever replay.
        mixed_captured = [t for t in self.mixed_buckets if max_num_seqs > FEW_SEQS or t not in self.few_buckets]
        # Largest first, so the smaller graphs fit in the memory pool the largest made.
        for tokens in reversed(mixed_captured):
            self._capture(forward, ("mixed", tokens), tokens, max_num_seqs + 1, max_query_len=tokens,
                          max_seq_len=max_model_len)
        for tokens in reversed(self.few_buckets):
            self._capture(forward, ("few", tokens), tokens, self.few_seqs + 1, max_query_len=tokens,
                          max_seq_len=max_model_len, split_decodes=False)
        for seqs in reversed(self.verify_buckets):
            self._capture(forward, ("verify", seqs), seqs * verify_query_len, seqs + 1,
                          max_query_len=verify_query_len, max_seq_len=max_model_len)
        self.long_decode_buckets = [b for b in self.decode_buckets if b <= DECODE_LONG_CONTEXT_MAX_SEQS] \
            if max_model_len > DECODE_LONG_CONTEXT else []
        for seqs in reversed(self.long_decode_buckets):
            self._capture(forward, ("decode-long", seqs), seqs, seqs, max_query_len=1, max_seq_len=max_model_len)
        for seqs in reversed(self.decode_buckets):
            self._capture(forward, ("decode", seqs), seqs, seqs, max_query_len=1,
                          max_seq_len=min(max_model_len, DECODE_LONG_CONTEXT))
        if sample is not None:
            for kind, sizes in (("decode-long", self.long_decode_buckets), ("decode", self.decode_buckets)):
                for n in sizes:
                    self._capture_sample(sample, (kind, n))
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs: decode batch sizes %s (and %s over contexts > %d); mixed token counts %s "
                    "(and %s for up to %d sequences)%s",
                    self.decode_buckets, self.long_decode_buckets, DECODE_LONG_CONTEXT, mixed_captured,
                    self.few_buckets, self.few_seqs,
                    (f"; verify batch sizes {self.verify_buckets} of {verify_query_len} tokens"
                     if self.verify_buckets else "")
                    + ("; decode steps sample in graphs" if self.sample_graphs else ""))

    def _capture(self, forward: Forward, key: tuple[str, int], num_tokens: int, num_seqs: int,
                 max_query_len: int, max_seq_len: int, split_decodes: bool = True) -> None:
        b = self.buffers
        views = b.fill_padding(num_tokens, num_seqs)  # the captures touch no real cache slot
        inputs = (views.input_ids, views.positions)
        forward(*inputs, b.metadata(num_tokens, num_seqs, max_query_len, max_seq_len, split_decodes))  # warm-up
        graph = torch.cuda.CUDAGraph()
        # A metadata object of its own: one keeps what its step's first layer derives for the rest
        # (AttentionMetadata.derived), which the graph must compute, not inherit from the warm-up.
        metadata = b.metadata(num_tokens, num_seqs, max_query_len, max_seq_len, split_decodes)
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[key] = forward(*inputs, metadata)
        self.pool = graph.pool()
        self.graphs[key] = graph

    def _capture_sample(self, sample: Sample, key: tuple[str, int]) -> None:
        hidden_states = self.outputs[key]
        self.buffers.views(key[1], key[1]).temperature.zero_()  # greedy: the capture draws nothing
        sample(hidden_states)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            sample(hidden_states)
        self.sample_graphs[key] = graph

    def can_sample(self, step: StepInputs) -> bool:
        """Whether `step` runs in a graph with a sampling graph behind it (a decode bucket)."""
        return self.bucket(step)[0] in self.sample_graphs

    def bucket(self, step: StepInputs) -> tuple[tuple[str, int], int, int]:
        """The graph that would hold `step` (its key: kind and size; size 0 when none is large
        enough), and the token and sequence counts the step is padded to for it."""
        num_seqs = len(step.req_ids)
        if step.max_query_len == 1:
            size = next((b for b in self.decode_buckets if b >= num_seqs), 0)
            long = step.max_seq_len > DECODE_LONG_CONTEXT and size in self.long_decode_buckets
            return ("decode-long" if long else "decode", size), size, size
        if step.max_query_len <= self.verify_query_len:  # every sequence fits a verify bucket's share
            size = next((b for b in self.verify_buckets if b >= num_seqs), 0)
            if size:
                return ("verify", size), size * self.verify_query_len, size + 1
        if not step_splits_decodes(num_seqs, step.num_tokens, step.max_query_len):
            size = next(b for b in self.few_buckets if b >= step.num_tokens)
            return ("few", size), size, self.few_seqs + 1
        size = next((b for b in self.mixed_buckets if b >= step.num_tokens), 0)
        if self.eager_prefill is not None and self.eager_prefill(step):
            size = 0
        return ("mixed", size), size, self.max_num_seqs + 1

    def run(self, step: StepInputs, before_replay: Callable[[], None] | None = None,
            sample: bool = False) -> torch.Tensor | None:
        """The step's hidden states through a graph, or None when no bucket holds it.
        `before_replay` runs once the inputs are in the buffers (to patch them on the device).
        With `sample` (can_sample(step) must hold) the sampling graph follows: the rows' tokens
        are then in buffers.sampled[:len(step.req_ids)]."""
        key, padded_tokens, padded_seqs = self.bucket(step)
        if key not in self.graphs:
            return None
        self.buffers.load(step, padded_tokens=padded_tokens, padded_seqs=padded_seqs)
        if before_replay is not None:
            before_replay()
        self.graphs[key].replay()
        if sample:
            self.sample_graphs[key].replay()
        out = self.outputs[key]  # (hidden states, residual) on a pipeline stage before the last
        return out[: step.num_tokens] if isinstance(out, torch.Tensor) else tuple(t[: step.num_tokens] for t in out)


def host_metadata(step: StepInputs, kv_layout: KVCacheLayout) -> AttentionMetadata:
    """A step's attention metadata straight from its host arrays (CPU: no persistent buffers)."""
    return AttentionMetadata(
        query_start_loc=torch.from_numpy(step.query_start_loc.astype(np.int32)),
        seq_lens=torch.from_numpy(step.seq_lens.astype(np.int32)),
        block_tables=torch.from_numpy(np.ascontiguousarray(step.block_table)),
        slot_mapping=torch.from_numpy(step.slot_mapping),
        max_query_len=step.max_query_len,
        max_seq_len=step.max_seq_len,
        kv_layout=kv_layout,
    )


# (input ids, the places of those still on the device, their places in the previous step's
# sampled ids) -> nothing: writes them in.
PatchInputIds = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def run_forward(forward: Forward, step: StepInputs, buffers: StepBuffers | None, graphs: StepGraphs | None,
                kv_layout: KVCacheLayout, patch_input_ids: PatchInputIds | None = None,
                sample: bool = False, sampled_rows_only: bool = False) -> torch.Tensor:
    """One forward pass over a step: a captured graph when one fits it, else eager from the
    persistent buffers (CUDA) or the host arrays (CPU). `patch_input_ids` may overwrite input ids
    in place once they are loaded (ids that are still on the device). `sample`: replay the
    step's sampling graph too (graphs.can_sample(step) must hold). `sampled_rows_only`: an eager
    step with prompt chunks may run its last layer for the sampled rows alone and return only
    theirs (worker/output_rows.py; it sets step.hidden_rows_sampled when it does)."""
    def forward_eager(input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        if not (sampled_rows_only and output_rows.wanted(step)):
            return forward(input_ids, positions, metadata)
        step.hidden_rows_sampled = True
        return forward(input_ids, positions, metadata,
                       output_rows=output_rows.output_rows(step, kv_layout, input_ids.device))

    if buffers is None:
        # A copy: patching must not write into the step's host array (a draft model's catch-up
        # reads that array afterwards and patches for itself, as it must on CUDA).
        input_ids = torch.from_numpy(step.input_ids.copy())
        if patch_input_ids is not None:
            none = np.zeros(0, dtype=np.int64)
            index, source = (none, none) if step.pending_token_index is None else \
                (step.pending_token_index, step.pending_source)
            patch_input_ids(input_ids, torch.from_numpy(index), torch.from_numpy(source))
        return forward_eager(input_ids, torch.from_numpy(step.positions), host_metadata(step, kv_layout))

    def patch() -> None:  # (the step's own ids, not a graph's padding)
        if patch_input_ids is not None:
            patch_input_ids(buffers.forward_inputs[0][: step.num_tokens], buffers.pending_index, buffers.pending_source)

    if graphs is not None:
        hidden_states = graphs.run(step, before_replay=patch, sample=sample)
        if hidden_states is not None:
            return hidden_states
    assert not sample, "sampling in a graph without one for the step"
    metadata = buffers.load(step)
    patch()
    return forward_eager(*buffers.forward_inputs, metadata)

