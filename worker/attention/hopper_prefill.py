"""Prefill attention on Hopper GPUs in CUDA: hopper_prefill.cu, built with nvcc at worker start.

The Triton prefill kernel stops near 480-500 TFLOP/s on an H100: Triton 3.6 issues a tile's two
products and its softmax one after another in the same warps. hopper_prefill.cu follows
FlashAttention-3: one warpgroup copies tiles into a ring of shared-memory buffers while two others
multiply with wgmma and run the softmax, taking turns at the tensor cores. A 128-key tile whose
cache blocks are a run of consecutive ids is copied with TMA (in any order where the causal mask
leaves the tile whole: a recycled pool hands out descending runs). Other tiles go by a TMA box per
block where blocks hold at least BLOCK_BOX_MIN_SLOTS slots, and are gathered with cp.async where
they are smaller (TMA boxes of one 16-slot block ran at half the speed).

It takes prefill steps of at least MIN_TOKENS tokens with a sequence of at least MIN_SEQ_LEN
(takes()): long prompts and the chunks after them. There it runs 1.1-1.3x as fast as Triton (H100, one
layer at 16k-32k) when each tile's blocks are a run of consecutive ids: ascending, as a fresh
engine hands them out, or descending, as a pool that has served a while does. A busy server's pool
scatters a long prompt's blocks: with blocks of 16 such steps stay on Triton (the gather is no
faster); with blocks of 64 (`block_size=64`) every tile goes by TMA, 1.1-1.2x as fast as Triton. Many
short prompts stay on Triton, whose smaller tiles win there. Those steps run eagerly
(cuda_graphs.StepGraphs' eager_prefill): the graphs capture Triton.

It serves bfloat16 queries and caches with head_dim 128 on compute capability 9.0, with blocks of
8 to 128 slots (a power of 2). Everything else, FP8 caches included, stays on Triton.

It is built at worker start (cuda_build.py) and loaded with ctypes. No nvcc, or a failed build:
the worker logs why once and stays on Triton.
$MINIVLLM_HOPPER_PREFILL=0 keeps Triton (for measuring).
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np
import torch
from minivllm.worker.attention.cuda_build import library_or_none
from minivllm.worker.attention.kv_cache import KVCacheLayout
from minivllm.worker.attention.metadata import AttentionMetadata

ENABLED = os.environ.get("MINIVLLM_HOPPER_PREFILL", "1") != "0"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hopper_prefill.cu")
HEAD_DIM = 128
TILE_ROWS = 128  # query rows and keys per tile (kBlockM, kBlockN in the source)
# Steps with fewer tokens, or no sequence this long, stay on the Triton kernel (takes()).
MIN_TOKENS = 2048
MIN_SEQ_LEN = 8192
# Blocks of at least this many slots go by a TMA box each (kBlockBoxMinSlots in the source): a box
# of 64 rows moves about as fast as one of 128, a box of 16 at half that speed.
BLOCK_BOX_MIN_SLOTS = 64
# Tiles gathered with cp.async run at about Triton's speed or slower, tiles copied by TMA 1.1-1.3x as
# fast: a step takes the kernel once a quarter of its long sequences' tiles go by TMA.
MIN_TMA_SHARE = 0.25
_ERROR_BYTES = 512


def load_library(path: str) -> ctypes.CDLL:
    """A built library, its entry point typed."""
    lib = ctypes.CDLL(path)
    fn = lib.minivllm_hopper_prefill
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, i64, i64, i32, i32, ptr, ptr, i64, i64, i64, i32, i32,
                   ptr, i64, ptr, ptr, i32, ctypes.c_float, i32, ptr, ctypes.c_char_p, i32]
    fn.restype = i32
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built (said once, in the log)."""
    return library_or_none(SOURCE, "minivllm_hopper_prefill", "Hopper prefill attention kernel", load_library,
                           "prefill attention stays on Triton")


def _serves(dtype: torch.dtype, layout: KVCacheLayout, device: torch.device) -> bool:
    return (ENABLED and device.type == "cuda" and dtype == torch.bfloat16 and layout.dtype == torch.bfloat16
            and layout.head_dim == HEAD_DIM and not layout.fp8 and 8 <= layout.block_size <= TILE_ROWS
            and TILE_ROWS % layout.block_size == 0 and torch.cuda.get_device_capability(device) == (9, 0))


def serves(dtype: torch.dtype, layout: KVCacheLayout, device: torch.device) -> bool:
    """Whether this model's long prefills go to the kernel (building it now, at start-up, if so)."""
    return _serves(dtype, layout, device) and library() is not None


def tma_share(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int) -> float:
    """Of the whole 128-key tiles of the sequences at least MIN_SEQ_LEN long, the share the kernel
    copies with TMA: every tile where blocks hold at least BLOCK_BOX_MIN_SLOTS slots; with smaller
    blocks, the tiles whose blocks are a run of consecutive ids, in order or not (copied as one box
    where the causal mask leaves the tile whole, which is nearly every tile of a long sequence; the
    rest are gathered). Host arrays: block_table [num_seqs, columns], seq_lens [num_seqs]."""
    if block_size >= BLOCK_BOX_MIN_SLOTS:
        return 1.0 if any(seq_len >= MIN_SEQ_LEN for seq_len in seq_lens) else 0.0
    blocks_per_tile = TILE_ROWS // block_size
    total = consecutive = 0
    for row, seq_len in zip(block_table, seq_lens):
        if seq_len < MIN_SEQ_LEN:
            continue
        tiles = int(seq_len) // TILE_ROWS
        groups = np.sort(row[: tiles * blocks_per_tile].reshape(tiles, blocks_per_tile).astype(np.int64), axis=1)
        consecutive += int((np.diff(groups, axis=1) == 1).all(axis=1).sum())
        total += tiles
    return consecutive / total if total else 0.0


def takes(num_tokens: int, max_seq_len: int, share: float | None = None) -> bool:
    """Whether a prefill step goes to the kernel (where it serves): big steps with a long sequence
    of which at least MIN_TMA_SHARE of the tiles go by TMA (`share`, tma_share's; None: not known,
    taken). Many short prompts stay on Triton, whose smaller tiles win there (H100: a step of 8,192
    tokens in 562-token prompts, 145 us a layer here against 101), and so do long ones in scattered
    blocks of fewer than BLOCK_BOX_MIN_SLOTS slots, where the gather is at or below Triton's speed."""
    return num_tokens >= MIN_TOKENS and max_seq_len >= MIN_SEQ_LEN and (share is None or share >= MIN_TMA_SHARE)


def takes_step(num_tokens: int, max_seq_len: int, block_table: np.ndarray, seq_lens: np.ndarray,
               block_size: int) -> tuple[bool, float | None]:
    """takes() for a step's host arrays, and the TMA share it computed (None: not needed)."""
    if not takes(num_tokens, max_seq_len):
        return False, None
    share = tma_share(block_table, seq_lens, block_size)
    return takes(num_tokens, max_seq_len, share), share


def supports(query: torch.Tensor, layout: KVCacheLayout, metadata: AttentionMetadata) -> bool:
    """Whether this prefill step goes to the kernel. Never inside a CUDA graph capture: the steps
    it takes run eagerly (cuda_graphs.StepGraphs' eager_prefill)."""
    return (takes(query.shape[0], metadata.max_seq_len, metadata.tma_share)
            and _serves(query.dtype, layout, query.device) and query.stride(2) == 1
            and not torch.cuda.is_current_stream_capturing() and library() is not None)


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                      metadata: AttentionMetadata, scale: float, out: torch.Tensor,
                      lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """out[t] = causal attention of query[t] over its sequence's cached keys (supports() must hold).
    With metadata.split_decodes the one-token sequences are left alone (the decode kernel's).
    lib: another build of the kernel (load_library's; benchmarks/hopper_variants.py), else library()."""
    views = layout.split(kv_cache)
    key, value = views.key, views.value  # [num_blocks, block_size, num_kv_heads, head_dim]
    if key.stride() != value.stride() or key.stride(3) != 1 or key.stride(0) != key.stride(1) * layout.block_size:
        raise ValueError(f"the cache's key and value views must be [slot, head, dim] rows, got strides {key.stride()}")
    tables = metadata.block_tables
    if out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {query.dtype} with unit stride along head_dim, got {out.dtype} {out.stride()}")
    for name, array in (("block_tables", tables), ("seq_lens", metadata.seq_lens),
                        ("query_start_loc", metadata.query_start_loc)):
        if array.dtype != torch.int32 or array.stride(-1) != 1:
            raise ValueError(f"metadata.{name} must be int32 with unit stride along its last dim, "
                             f"got {array.dtype} {array.stride()}")
    num_tokens, num_heads, _ = query.shape
    error = ctypes.create_string_buffer(_ERROR_BYTES)
    status = (lib or library()).minivllm_hopper_prefill(
        out.data_ptr(), out.stride(0), out.stride(1), query.data_ptr(), query.stride(0), query.stride(1),
        num_tokens, num_heads, key.data_ptr(), value.data_ptr(), key.shape[0] * layout.block_size, key.stride(1),
        key.stride(2), layout.num_kv_heads, layout.block_size,
        tables.data_ptr(), tables.stride(0), metadata.seq_lens.data_ptr(), metadata.query_start_loc.data_ptr(),
        metadata.num_seqs, scale * 1.4426950408889634, int(metadata.split_decodes),
        torch.cuda.current_stream(query.device).cuda_stream, error, _ERROR_BYTES)
    if status != 0:
        raise RuntimeError(f"Hopper prefill attention: {error.value.decode(errors='replace')}")
    return out
