"""A prefill step's last layer, run only for the rows the step samples from.

A step's hidden states leave the model only at the rows whose logits are taken: each sampling
sequence's last token. In the last layer, attention and the MLP at every other row feed nothing.
So an eager step with prompt chunks runs its last layer in two parts:
  - every token: the qkv projection, the norm and RoPE, and the store of its K/V (later steps
    attend to them);
  - the sampled rows only: attention, each row its sequence's last query over the whole context
    (a decode over those sequences), then o_proj, the norm and the MLP.
For a 32k-token prompt that is 1/28 of its attention (most of a long prefill) and of its MLP,
and a chunk that samples nothing skips them entirely.

Not used where every position's hidden state is wanted (prompt logprobs, speculative decoding,
a pipeline stage before the last, which sends them on), in a CUDA graph (its shapes are its
bucket's), or with an FP8 cache: there the prefill reads a chunk's own keys unquantized, and a
decode over the cache would read them in e4m3.
$MINIVLLM_LAST_LAYER_ALL_ROWS=1 runs the whole last layer (for measuring).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.worker.attention.kv_cache import KVCacheLayout
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.input_batch import StepInputs

ENABLED = os.environ.get("MINIVLLM_LAST_LAYER_ALL_ROWS", "0") != "1"


@dataclass
class OutputRows:
    """The rows a step samples from, and how to attend from them alone."""

    indices: torch.Tensor  # [n] int64: their token rows, in the order the logits are taken
    # n one-token sequences: row i is the last query of the step's sequence sampling_req_index[i]
    metadata: AttentionMetadata


def wanted(step: StepInputs) -> bool:
    """Whether the step has rows whose last-layer work nobody reads: prompt chunks, each sampling at
    most its last token (drafts to verify sample at several)."""
    return (ENABLED and step.max_query_len > 1 and step.spec_logits_indices is None
            and len(step.logits_indices) < step.num_tokens)


def output_rows(step: StepInputs, kv_layout: KVCacheLayout, device: torch.device) -> OutputRows:
    """The step's sampled rows on `device`, with the metadata of a decode over their sequences."""
    sampling = step.sampling_req_index
    seq_lens = step.seq_lens[sampling]
    num_rows = len(sampling)

    def to_device(array: np.ndarray, dtype: np.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).to(device, non_blocking=True)

    metadata = AttentionMetadata(
        query_start_loc=to_device(np.arange(num_rows + 1), np.int32),
        seq_lens=to_device(seq_lens, np.int32),
        block_tables=to_device(step.block_table[sampling], np.int32),
        slot_mapping=to_device(step.slot_mapping[step.logits_indices], np.int64),
        max_query_len=1,
        max_seq_len=int(seq_lens.max(initial=0)),
        kv_layout=kv_layout,
    )
    return OutputRows(to_device(step.logits_indices, np.int64), metadata)
