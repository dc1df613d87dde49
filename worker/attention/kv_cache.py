"""How one layer's paged KV cache is laid out in memory: plain, or FP8 with scales.

Plain (kv_cache_dtype="auto"): one tensor of the model's dtype,
    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]   (K = [0], V = [1]).

FP8 (kv_cache_dtype="fp8", vLLM's name; the format is e4m3): each key and value vector (one token,
one KV head) is stored as head_dim e4m3 bytes plus one bfloat16 scale, amax(|x|) / 448 rounded up
to a bfloat16, so the largest element maps to (at most) e4m3's largest finite value and every
vector uses the format's whole range (one per-tensor scale, as vLLM's default, can leave
outlier-free heads with a few significant bits). The scale's 8 significant bits cost nothing the
data's 4 would notice, and half the bytes of a float32 one: a decode step's bare reads take 1.9%
less time so, the CUDA decode kernel ~1% (H100, benchmarks/results/2026-11-27-host-gaps/). A block
keeps its data and then its scales in one uint8 row:
    kv_cache[2, num_blocks, block_bytes], block_bytes = block_size * num_kv_heads * (head_dim + 2)
    K row = [num_kv_heads, block_size, head_dim] e4m3 | [num_kv_heads, block_size] bfloat16 scales
    V row = [num_kv_heads, block_size, head_dim] e4m3 | [num_kv_heads, block_size] bfloat16 scales
Everything is stored head by head, so that one head's share of a block (what one attention program
reads) is one run of bytes: 2 KiB of keys and 2 KiB of values at head_dim 128 and blocks of 16 (with
keys [block_size, num_kv_heads, head_dim], as the plain cache has them, the decode kernels read
FP8 caches 1.5% slower). A token's values are one row, as its keys are. The P.V product needs
each dim's values for consecutive keys side by side, which the CUDA decode kernel makes from four
keys' rows in registers (fp8_decode.cu) and Triton's kernels in their own layouts. Values used to be
stored transposed ([num_kv_heads, head_dim, block_size]) for that; then a decode step's value store
wrote one byte into each of 128 rows a token, and the attention kernel after it ran ~3 us a layer
longer (H100, 256 sequences: benchmarks/results/2026-11-28-rope-passes/). `split` gives views
indexed [block, slot, head, dim] whatever the order.
Stored vectors never hold NaN or infinity (they are replaced by 0 and clamped to +-FINITE_MAX first),
so a kernel may read a whole block's slots, written or not, and zero the unused ones by their
weights.
The scales cost 2 / head_dim of the bytes (1.6% at head_dim 128); the cache holds about twice the
tokens of a bf16 one and a decode step reads about half the bytes.

Either way kv_cache[:, block_id] is the whole state of one block, so whatever copies blocks
(offloading, swapping, transfer to another instance) needs no knowledge of the format.
`split` gives the attention backends typed views of the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from minivllm.protocol.config import FP8_SCALE_BYTES

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
SCALE_DTYPE = torch.bfloat16  # one per (token, KV head)
assert torch.empty((), dtype=SCALE_DTYPE).element_size() == FP8_SCALE_BYTES
# A vector of zeros gets this scale instead of 0, so dequantizing never divides by zero.
MIN_SCALE = 1e-12
# Elements are clamped to +-this before quantizing (below float32's largest by more than the scale's
# rounding up, so that every stored vector dequantizes to finite values).
FINITE_MAX = 3.0e38


class KVCacheViews(NamedTuple):
    """Views indexed [block, slot, head, dim] (scales [block, slot, head]) whatever the memory order:
    read strides off them, never assume contiguity."""
    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], model dtype or e4m3
    value: torch.Tensor
    key_scale: torch.Tensor | None  # [num_blocks, block_size, num_kv_heads] bfloat16 (FP8 only)
    value_scale: torch.Tensor | None


@dataclass(frozen=True)
class KVCacheLayout:
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's dtype: what keys and values are computed (and dequantized) in
    fp8: bool = False

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K (or of V) in one layer."""
        tokens_heads = self.block_size * self.num_kv_heads
        if self.fp8:
            return tokens_heads * (self.head_dim + FP8_SCALE_BYTES)
        return tokens_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.fp8:
            return (2, num_blocks, self.block_bytes)
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        return self.allocate_layers(1, num_blocks, device)[0]

    def allocate_layers(self, num_layers: int, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """One cache per layer, as views of one tensor [num_layers, *shape]: a copy of whole
        blocks (the CPU offload tier) can then move every layer's K and V in one indexing op."""
        stacked = torch.zeros((num_layers, *self.shape(num_blocks)), dtype=torch.uint8 if self.fp8 else self.dtype,
                              device=device)
        return list(stacked.unbind(0))

    def split(self, kv_cache: torch.Tensor) -> KVCacheViews:
        if not self.fp8:
            return KVCacheViews(kv_cache[0], kv_cache[1], None, None)
        num_blocks, size, heads, dim = kv_cache.shape[1], self.block_size, self.num_kv_heads, self.head_dim
        data = kv_cache[:, :, : size * heads * dim].view(FP8_DTYPE)
        key = data[0].view(num_blocks, heads, size, dim).permute(0, 2, 1, 3)
        value = data[1].view(num_blocks, heads, size, dim).permute(0, 2, 1, 3)
        scales = kv_cache[:, :, size * heads * dim :].view(SCALE_DTYPE).view(2, num_blocks, heads, size).transpose(2, 3)
        return KVCacheViews(key, value, scales[0], scales[1])


def stacked_layers(kv_caches: list[torch.Tensor], user: str) -> torch.Tensor:
    """The layers' caches as the one tensor [num_layers, 2, num_blocks, ...] they are views of
    (allocate_layers), so that one indexing op moves a block's K and V in every layer. `user`
    names who needs that, for the error when they are not such views."""
    first = kv_caches[0]
    layer_stride = kv_caches[1].storage_offset() - first.storage_offset() if len(kv_caches) > 1 else 0
    for i, cache in enumerate(kv_caches):
        if (cache.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or cache.storage_offset() != first.storage_offset() + i * layer_stride
                or cache.shape != first.shape or cache.stride() != first.stride() or cache.dtype != first.dtype):
            raise ValueError(f"{user} needs the layers' KV caches as views of one tensor "
                             "(KVCacheLayout.allocate_layers)")
    return first.as_strided((len(kv_caches), *first.shape), (layer_stride, *first.stride()), first.storage_offset())


def plain_layout(kv_cache: torch.Tensor) -> KVCacheLayout:
    """The layout of a plain [2, num_blocks, block_size, num_kv_heads, head_dim] cache."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return KVCacheLayout(block_size, num_kv_heads, head_dim, kv_cache.dtype)


def round_up_to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    """Positive finite float32 x -> the least bfloat16 value >= x, as float32 (exactly stored as a
    bfloat16). Clearing the low 16 bits after adding 0xFFFF carries into the exponent as needed.
    The kernels that store scales do the same."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & -0x10000).view(torch.float32)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (e4m3 [..., head_dim], scale [...]) with x ~= e4m3 * scale; the scale is
    float32 holding a bfloat16 value (amax / FP8_MAX rounded up, so no element maps past FP8_MAX).
    NaN becomes 0 and anything past +-FINITE_MAX (infinities too) is clamped to it: the cache must
    hold finite values only, and 448 times a scale rounded up from float32's largest would not be."""
    x = torch.nan_to_num(x.float(), nan=0.0).clamp(-FINITE_MAX, FINITE_MAX)
    amax = x.abs().amax(dim=-1)
    # A true division, as the kernels' (on CUDA torch divides by a Python number as a multiplication
    # by its reciprocal, an ulp off at times, which the rounding up can turn into a bfloat16 step).
    scale = round_up_to_bfloat16((amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE))
    return (x / scale[..., None]).to(FP8_DTYPE), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * scale[..., None]).to(dtype)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             layout: KVCacheLayout | None = None) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their flat cache slots (plain torch;
    the CUDA backend has its own kernel). layout None: a plain cache."""
    layout = layout if layout is not None else plain_layout(kv_cache)
    views = layout.split(kv_cache)
    if not layout.fp8:
        num_slots = views.key.shape[0] * layout.block_size
        for cache, x in ((views.key, key), (views.value, value)):
            cache.view(num_slots, layout.num_kv_heads, layout.head_dim).index_copy_(0, slot_mapping, x.to(cache.dtype))
        return
    # An FP8 block holds its scales after its data, so slots are addressed as (block, offset).
    blocks, offsets = slot_mapping // layout.block_size, slot_mapping % layout.block_size
    for cache, scale_cache, x in ((views.key, views.key_scale, key), (views.value, views.value_scale, value)):
        data, scale = quantize(x)
        cache.view(torch.uint8)[blocks, offsets] = data.view(torch.uint8)  # no float8 index_put on the CPU
        scale_cache[blocks, offsets] = scale.to(scale_cache.dtype)  # (exact: quantize rounds to one)


def gather(views: KVCacheViews, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at flat `slots` (any shape), dequantized to `dtype`: [*slots.shape, heads, dim]."""
    block_size = views.key.shape[1]
    if views.key_scale is not None:
        blocks, offsets = slots // block_size, slots % block_size
    out = []
    for cache, scale_cache in ((views.key, views.key_scale), (views.value, views.value_scale)):
        if scale_cache is None:  # contiguous: one flat index is cheaper than (block, offset)
            num_blocks, _, num_kv_heads, head_dim = cache.shape
            # index_select copies whole rows: 3-4x faster on the CPU than the same gather written
            # as cache[slots] (advanced indexing), in fp32 and bf16 alike.
            rows = cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_select(0, slots.reshape(-1))
            out.append(rows.view(*slots.shape, num_kv_heads, head_dim))
        else:
            data = cache.view(torch.uint8)[blocks, offsets].view(FP8_DTYPE)
            out.append(dequantize(data, scale_cache[blocks, offsets], dtype))
    return out[0], out[1]
