"""Paged attention on the CPU through torch's fused scaled_dot_product_attention.

The reference backend (reference.py) walks block-table columns with a dozen small tensor ops
each; on a CPU those ops' overhead, not arithmetic, sets the speed. Here each step gathers every
sequence's context once into a contiguous [keys, kv_heads, head_dim] tensor and hands it to
SDPA, whose CPU kernel is a tiled flash attention:

- Decodes (one query token each) go in batched calls: contexts are padded to the longest of
  their group, and a boolean mask hides the padding. Padded positions gather the sequence's own
  slot 0 rather than whatever the pool holds there, so they are finite and the mask zeroes them
  exactly (a cache slot never written may hold NaN, and 0 * NaN is NaN). A group holds contexts
  of at least half its longest (up to MAX_DECODE_GROUPS groups, by length), so that short
  contexts are not padded to a long one's length: the gather and the attention scale with it.
- Prefill chunks go one sequence at a time: a chunk's queries are the last `query_len` of
  its `seq_len` positions, so the causal mask is shifted by the cached prefix (plain
  is_causal when there is none).

With a 16-bit cache the decodes skip all that: cpu_decode.py's kernel reads their keys and
values in place from the blocks, all decodes in one call.

Which rows are decodes, and the gather indices, depend only on the step, not the layer: they
are worked out once per step (for the first layer) and reused by the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.worker.attention import cpu_decode
from minivllm.worker.attention.metadata import AttentionBackend, AttentionMetadata
from minivllm.worker.attention.kv_cache import gather, write_kv


@dataclass
class PrefillChunk:
    rows: slice  # its query rows in the packed batch
    slots: torch.Tensor  # [seq_len] flat cache slots of positions 0..seq_len-1
    causal_mask: torch.Tensor | None  # [query_len, seq_len], None when it has no cached prefix


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [n] query rows of single-token sequences
    slots: torch.Tensor  # [n, longest context] flat slots (padding: slot of position 0)
    mask: torch.Tensor  # [n, 1, 1, longest context] True where the key is real


@dataclass
class StepPlan:
    decodes: list[DecodeGroup]  # for SDPA (none when the kernel takes the decodes)
    prefills: list[PrefillChunk]
    decode_rows: torch.Tensor  # [n] int64: every decode's query row, for cpu_decode's kernel
    decode_seqs: torch.Tensor  # [n] int64: its sequence


MAX_DECODE_GROUPS = 4


def plan_step(metadata: AttentionMetadata, block_size: int, decode_groups: bool = True) -> StepPlan:
    """decode_groups: also the decodes' SDPA groups (not needed when the kernel takes them)."""
    query_start = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    block_tables = metadata.block_tables.long()
    offsets = torch.arange(block_size)
    decode_seqs, prefills = [], []
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start[i], query_start[i + 1]
        if end - start == 1:
            decode_seqs.append(i)
            continue
        num_blocks = -(-seq_len // block_size)
        slots = (block_tables[i, :num_blocks, None] * block_size + offsets).flatten()[:seq_len]
        mask = None
        query_len = end - start
        if query_len != seq_len:  # query i is position seq_len - query_len + i: it sees keys up to there
            mask = torch.ones(query_len, seq_len, dtype=torch.bool).tril(seq_len - query_len)
        prefills.append(PrefillChunk(slice(start, end), slots, mask))

    decode_rows = torch.tensor([query_start[i] for i in decode_seqs], dtype=torch.long)
    decode_seq_ids = torch.tensor(decode_seqs, dtype=torch.long)
    if not decode_groups:
        return StepPlan([], prefills, decode_rows, decode_seq_ids)
    # Longest first; a new group starts where a context is under half the group's longest.
    decode_seqs.sort(key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    for i in decode_seqs:
        if not groups or (2 * seq_lens[i] < seq_lens[groups[-1][0]] and len(groups) < MAX_DECODE_GROUPS):
            groups.append([])
        groups[-1].append(i)
    decodes = []
    for group in groups:
        lens = torch.tensor([seq_lens[i] for i in group])
        longest = seq_lens[group[0]]
        num_blocks = -(-longest // block_size)
        slots = (block_tables[group, :num_blocks, None] * block_size + offsets).flatten(1)[:, :longest]
        real = torch.arange(longest)[None, :] < lens[:, None]
        decodes.append(DecodeGroup(torch.tensor([query_start[i] for i in group], dtype=torch.long),
                                   torch.where(real, slots, slots[:, :1]), real[:, None, None, :]))
    return StepPlan(decodes, prefills, decode_rows, decode_seq_ids)


class SdpaAttentionBackend(AttentionBackend):
    """The CPU AttentionBackend (see worker/attention/metadata.py for the interface)."""

    name = "cpu-sdpa"

    def plan(self, metadata: AttentionMetadata, block_size: int, decode_groups: bool = True) -> StepPlan:
        """The step's plan: worked out by its first layer, reused by the others."""
        return metadata.derived(("cpu-sdpa plan", block_size, decode_groups),
                                lambda: plan_step(metadata, block_size, decode_groups))

    def store(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              metadata: AttentionMetadata) -> None:
        write_kv(key, value, kv_cache, metadata.slot_mapping, metadata.layout(kv_cache))

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
        """(Every key from the cache: key and value are not read.)"""
        layout = metadata.layout(kv_cache)
        kernel = cpu_decode.supports(query, layout)
        plan = self.plan(metadata, layout.block_size, decode_groups=not kernel)
        views = layout.split(kv_cache)  # an FP8 cache is dequantized to the query's dtype as it is gathered
        gqa = query.shape[1] != layout.num_kv_heads
        out = torch.empty_like(query)

        if kernel and len(plan.decode_rows):
            cpu_decode.decode_attention(query, views, metadata.block_tables, metadata.seq_lens, plan.decode_rows,
                                        plan.decode_seqs, scale, out)

        for group in plan.decodes:
            # [decodes, heads, 1, dim] against [decodes, kv_heads, longest, dim]
            q = query[group.rows].unsqueeze(2)
            k, v = gather(views, group.slots, query.dtype)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=gqa)
            out[group.rows] = attended.squeeze(2)

        for chunk in plan.prefills:
            q = query[chunk.rows].transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, dim]
            k, v = gather(views, chunk.slots, query.dtype)
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.causal_mask, scale=scale,
                                                      is_causal=chunk.causal_mask is None, enable_gqa=gqa)
            out[chunk.rows] = attended.squeeze(0).transpose(0, 1)
        return out
