"""What an attention backend is told about one step's batch, and the interface a backend offers.

A step's tokens are packed flat: the tokens of sequence i are rows
[query_start_loc[i], query_start_loc[i+1]) of q/k/v. A sequence with several tokens is a
prefill chunk (it may already have a cached prefix); one with a single token is a decode.
Both kinds share one call, so the backend never has to know which is which.

KV cache layout (one tensor per layer):
    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
        kv_cache[0] = keys, kv_cache[1] = values.
Token slot s lives at block s // block_size, offset s % block_size, so
kv_cache[i].view(num_blocks * block_size, num_kv_heads, head_dim)[s] is its key/value.
An FP8 cache (kv_cache_dtype="fp8") packs each block's e4m3 data and scales into one byte row;
kv_cache.py describes it, and `metadata.layout(kv_cache).split(kv_cache)` gives typed views of either.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from minivllm.worker.attention.kv_cache import KVCacheLayout, plain_layout


# A decode step whose longest context is longer than this may split its keys more ways (up to 16
# against 8 below it, which only long contexts gain from): CUDA graphs capture small decode
# batches both ways.
DECODE_LONG_CONTEXT = 1024
# Decode batches up to this many sequences get the long-context graphs too (larger ones fill the
# GPU without splitting).
DECODE_LONG_CONTEXT_MAX_SEQS = 64
# A step with prefill chunks and at most FEW_SEQS sequences and FEW_SEQS_MAX_TOKENS tokens (a first
# token at low load) attends every sequence in one kernel, its decodes too (metadata.split_decodes False):
# a second kernel for its few decodes costs more than the rows they leave empty in a prefill tile.
FEW_SEQS = 8
FEW_SEQS_MAX_TOKENS = 512


# Such a step of at most FEW_SEQS_SPLIT_MAX_TOKENS tokens also shares each sequence's cached context
# out among several programs per query tile (by its length, in the kernel), as flash-decoding does
# for a decode: a short chunk after a long prefix (a new turn of a long chat) would otherwise leave
# most SMs idle, its few query tiles each walking the whole prefix.
FEW_SEQS_SPLIT_MAX_TOKENS = 256


def step_splits_decodes(num_seqs: int, num_tokens: int, max_query_len: int) -> bool:
    """Whether a step's one-token sequences go to a decode kernel of their own (see FEW_SEQS)."""
    return max_query_len == 1 or num_seqs > FEW_SEQS or num_tokens > FEW_SEQS_MAX_TOKENS


def step_splits_contexts(split_decodes: bool, num_tokens: int) -> bool:
    """Whether a step with prefill chunks shares its contexts out (see FEW_SEQS_SPLIT_MAX_TOKENS)."""
    return not split_decodes and num_tokens <= FEW_SEQS_SPLIT_MAX_TOKENS


@dataclass
class AttentionMetadata:
    # [num_seqs + 1] int32: prefix sum of query lengths; sequence i owns token rows
    # query_start_loc[i] : query_start_loc[i+1].
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length of each sequence INCLUDING this step's tokens.
    seq_lens: torch.Tensor
    # [num_seqs, max_num_blocks] int32: the physical block ids of each sequence, in order.
    # Entries past a sequence's last block must still be valid block ids (we pad with 0);
    # they are masked out, never trusted.
    block_tables: torch.Tensor
    # [num_tokens] int64: the flat cache slot each new token's K/V is written to.
    slot_mapping: torch.Tensor
    # Host-side maxima, so backends can size loops/grids without a device sync.
    max_query_len: int
    max_seq_len: int
    # How the cache tensors are laid out (worker/attention/kv_cache.py). None: plain, read off the
    # tensor's shape; an FP8 cache must say so.
    kv_layout: KVCacheLayout | None = None
    # [1] int32 on the device, or None: sequences [0, n) hold the step's tokens and the rest are
    # empty. A CUDA graph's sequence count is its bucket's, mostly empty padding; this lets a
    # kernel whose grid spans every sequence skip the empty ones without searching for them.
    num_active_seqs: torch.Tensor | None = None
    # Whether the one-token sequences of a step with prefill chunks go to a decode kernel of their
    # own (False: the prefill kernel takes every sequence; step_splits_decodes()).
    split_decodes: bool = True
    # Of the 128-key tiles of the step's long sequences, the share the Hopper prefill kernel copies
    # with TMA (hopper_prefill.tma_share, computed on the host for the steps that kernel would
    # take); None: not known.
    tma_share: float | None = None
    # [num_seqs] int32 on the device, or None: the sequences by decreasing length, where the step's
    # inputs carry it (StepBuffers sorts a decode step's lengths on the host, which costs a GPU step
    # nothing; a sort on the device took ~20 us of a 256-sequence step). longest_first() uses it.
    seq_order: torch.Tensor | None = None
    # What backends derive from the step once for all its layers (derived()); a copy made with
    # dataclasses.replace starts empty.
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def derived(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """What compute() gives for this step: computed by the first layer that asks, then shared
        by the rest (a metadata object is one step; in a CUDA graph the computation is part of the
        first layer, so a capture must not reuse its warm-up's object)."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    def longest_first(self) -> torch.Tensor:
        """The sequence indices by decreasing length (int32, on the lengths' device)."""
        if self.seq_order is not None:
            return self.seq_order
        return self.derived("longest_first", lambda: torch.argsort(self.seq_lens, descending=True).to(torch.int32))

    def layout(self, kv_cache: torch.Tensor) -> KVCacheLayout:
        return self.kv_layout if self.kv_layout is not None else plain_layout(kv_cache)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The per-layer KV cache shape every backend agrees on (see the module docstring)."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


class RopeInputs(NamedTuple):
    """A decode step's rotation, for a backend that rotates inside its attention (rotates_in_decode):
    this step's key and value [num_tokens, num_kv_heads, head_dim] as the qkv projection gave them,
    each token's position, RoPE's cos/sin tables [max_position, rotary_dim // 2] (fp32), and the
    per-head RMSNorm weights applied before rotating (Qwen3; None: no norm)."""

    key: torch.Tensor
    value: torch.Tensor
    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6


class AttentionBackend:
    """Paged attention for one layer: store this step's K/V, then attend over the cache. A backend
    gives the two halves:

      store(key, value, kv_cache, metadata)       key/value [num_tokens, num_kv_heads, head_dim]
                                                  to their slots (metadata.slot_mapping)
      attend(query, kv_cache, metadata, scale, key, value)
                                                  query [num_tokens, num_heads, head_dim]
                                                  -> output [num_tokens, num_heads, head_dim];
                                                  key/value: this step's, already stored (a
                                                  backend may read a chunk's own keys from them)

    A backend with stores_kv_with_rope lets the RoPE kernel write the K/V (ops.norm_rope), and
    the layer then calls forward with kv_stored=True.

    A backend with rotates_in_decode takes a decode-only step (max_query_len 1) before the per-head
    norm and RoPE: decode_rotating(query, kv_cache, metadata, scale, rope) norms and rotates q and
    k itself, stores k and v, and attends.
    """

    name: str
    stores_kv_with_rope: bool = False
    rotates_in_decode: bool = False

    def store(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              metadata: AttentionMetadata) -> None:
        raise NotImplementedError

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def decode_rotating(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                        scale: float, rope: RopeInputs) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, kv_stored: bool = False) -> torch.Tensor:
        if not kv_stored:
            self.store(key, value, kv_cache, metadata)
        return self.attend(query, kv_cache, metadata, scale, key, value)
