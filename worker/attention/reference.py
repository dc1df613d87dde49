"""Paged attention in plain torch: the CPU path, and the ground truth for faster kernels.

How paged attention works
-------------------------
The KV cache is not one contiguous buffer per sequence. It is a pool of fixed-size blocks
(`block_size` token slots each); a sequence owns a list of block ids, its *block table*,
and token position p of that sequence lives in block `block_table[p // block_size]` at
offset `p % block_size`. Blocks are handed out from a free list, so a sequence's blocks
may be anywhere in the pool and in any order.

Each step:
  1. `write_kv` scatters the new tokens' keys/values to their slots (`slot_mapping`,
     computed by the model runner from the block tables) with one indexed copy.
  2. `paged_attention` lets every query token attend to keys 0..its own position of its
     own sequence. It walks the block table one column at a time — column j holds
     positions [j*block_size, (j+1)*block_size) — gathering that block's K/V straight
     from the pool, and folds it into an *online softmax* (running max `m`, running
     denominator `l`, running weighted sum `acc`), as FlashAttention / vLLM's paged
     kernels do. Nothing ever assembles a contiguous copy of a sequence's context.

Prefill chunks and decodes are handled by the same code: a query token at position p
sees keys at positions <= p, which is the causal mask for a chunk (its cached prefix plus
the chunk's earlier tokens) and "everything so far" for a decode.

Here every query token walks its own sequence's block table (vectorized over tokens,
looped over block columns). A GPU kernel would tile queries of one sequence together to
reuse each K/V block; the arithmetic is the same.
"""

from __future__ import annotations

import torch

from minivllm.worker.attention.kv_cache import FP8_DTYPE, dequantize, write_kv
from minivllm.worker.attention.metadata import AttentionBackend, AttentionMetadata

__all__ = ["ReferenceAttentionBackend", "paged_attention", "token_positions", "write_kv"]


def token_positions(metadata: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed query token: (index of its sequence, its position in that sequence)."""
    query_start_loc = metadata.query_start_loc.long()
    seq_lens = metadata.seq_lens.long()
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_index = torch.repeat_interleave(
        torch.arange(metadata.num_seqs, device=seq_lens.device), query_lens, output_size=num_tokens
    )
    # A chunk's tokens are the last query_len positions of the sequence's context.
    context_before = seq_lens - query_lens
    offset_in_chunk = torch.arange(seq_index.shape[0], device=seq_lens.device) - query_start_loc[seq_index]
    return seq_index, context_before[seq_index] + offset_in_chunk


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of query [num_tokens, num_heads, head_dim] over the paged cache."""
    num_tokens, num_heads, head_dim = query.shape
    layout = metadata.layout(kv_cache)
    block_size, num_kv_heads = layout.block_size, layout.num_kv_heads
    group = num_heads // num_kv_heads  # GQA: `group` query heads share one KV head
    views = layout.split(kv_cache)

    def gather_block(cache: torch.Tensor, scales: torch.Tensor | None, block_ids: torch.Tensor) -> torch.Tensor:
        if scales is None:
            return cache[block_ids].float()
        return dequantize(cache.view(torch.uint8)[block_ids].view(FP8_DTYPE), scales[block_ids], torch.float32)

    seq_index, position = token_positions(metadata, num_tokens)
    token_block_table = metadata.block_tables[seq_index].long()  # [num_tokens, max_num_blocks]

    # Softmax statistics in fp32 whatever the cache dtype.
    q = query.float().view(num_tokens, num_kv_heads, group, head_dim) * scale
    running_max = torch.full((num_tokens, num_kv_heads, group), float("-inf"), device=query.device)
    running_sum = torch.zeros((num_tokens, num_kv_heads, group), device=query.device)
    acc = torch.zeros((num_tokens, num_kv_heads, group, head_dim), device=query.device)
    offsets_in_block = torch.arange(block_size, device=query.device)

    num_block_columns = (metadata.max_seq_len + block_size - 1) // block_size
    for column in range(num_block_columns):
        # Gather block `column` of every token's sequence: [num_tokens, block_size, kv_heads, head_dim].
        block_ids = token_block_table[:, column]
        keys = gather_block(views.key, views.key_scale, block_ids)
        values = gather_block(views.value, views.value_scale, block_ids)

        # Causal + length mask: key position must be <= the query token's position. This also
        # hides slots past the sequence's end and padded block-table entries.
        key_position = column * block_size + offsets_in_block  # [block_size]
        visible = key_position[None, :] <= position[:, None]  # [num_tokens, block_size]

        scores = torch.einsum("thgd,tbhd->thgb", q, keys)
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        # Unwritten slots may hold garbage (even NaN); zero them so 0 * garbage stays 0.
        values = values.masked_fill(~visible[:, :, None, None], 0.0)

        # Online softmax: rescale what we have so far to the new running max, then add this block.
        # Column 0 always holds position 0, visible to every token, so the max is finite from
        # the first iteration on and exp(-inf - max) = 0 for masked keys afterwards.
        new_max = torch.maximum(running_max, scores.amax(dim=-1))
        correction = torch.exp(running_max - new_max)
        probs = torch.exp(scores - new_max[..., None])
        running_sum = running_sum * correction + probs.sum(dim=-1)
        acc = acc * correction[..., None] + torch.einsum("thgb,tbhd->thgd", probs, values)
        running_max = new_max

    out = acc / running_sum[..., None]
    return out.view(num_tokens, num_heads, head_dim).to(query.dtype)


class ReferenceAttentionBackend(AttentionBackend):
    """The pure-torch AttentionBackend (see worker/attention/metadata.py for the interface)."""

    name = "reference"

    def store(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              metadata: AttentionMetadata) -> None:
        write_kv(key, value, kv_cache, metadata.slot_mapping, metadata.layout(kv_cache))

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
        """(Every key from the cache: key and value are not read.)"""
        return paged_attention(query, kv_cache, metadata, scale)
