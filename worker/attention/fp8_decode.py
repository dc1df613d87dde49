"""Decode attention over an FP8 KV cache in CUDA: fp8_decode.cu, built at worker start.

Triton's decode kernel reads a bf16 cache at ~2.84 TB/s on an H100 but an FP8 one at ~2.4: for
half the bytes its loop issues as many instructions (the e4m3 widening, the operands' trips
through shared memory, a padded 16-row softmax), and the copies of one tile wait for the math of
the one before. fp8_decode.cu copies each cache block's K, V and scales with cp.async into a ring of
shared-memory stages, two blocks ahead of the math, and reads them from there in the order the
tensor cores take them, with the queries as the product's narrow side (its header says how): the
cache at ~2.6 TB/s, 85% of the DRAM bandwidth by ncu (Triton's: 78%, bf16: 88%).

It serves steps of at least MIN_SEQS sequences over FP8 caches with head_dim 128, blocks of 16
slots and at most 8 query heads per KV head, for float16 or bfloat16 queries, on compute capability
9.0 (the build is sm_90a): decode-only steps (one query token per sequence), and the decodes of
steps with prefill chunks (each sequence's query row from query_start_loc; the chunks' programs
exit). Everything else stays on Triton, and so does any step when the build fails (the worker says
why once). $MINIVLLM_FP8_DECODE_CUDA=0 keeps Triton (for measuring).

With PDL (worker/pdl.py) the kernel's CTAs start while the kernel before it (ops.norm_rope) still
runs: they read the step's lengths, block tables and order and send their first cache copies,
then wait for it before reading the query or any sequence's last block, which that kernel writes.

A decode step that hands its attention q and k before their norm and RoPE (decode_attention's
`rope`) gets them from ops.norm_rope's kernel first, which also stores this step's K/V, rotating
the projection's output in place. Doing that inside this kernel (tried: the warp holding a
sequence's newest block normed, rotated and stored it, and patched its copy of the block) was no
faster: the chain of loads it puts in front of one warp holds up its block's programs longer than
the separate kernel takes (H100, the 256-request decode step's forward: 5.44-5.58 ms against
5.40-5.45).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from minivllm.worker import pdl
from minivllm.worker.attention.cuda_build import library_or_none
from minivllm.worker.attention.kv_cache import KVCacheLayout, KVCacheViews
from minivllm.worker.attention.metadata import AttentionMetadata

ENABLED = os.environ.get("MINIVLLM_FP8_DECODE_CUDA", "1") != "0"
# The first wave's KV heads start their loops up to 8 us apart (fp8_decode.cu's kStaggerSpanNs says
# why); "0" keeps them in step (for measuring).
STAGGER = os.environ.get("MINIVLLM_FP8_DECODE_STAGGER", "1") != "0"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp8_decode.cu")
HEAD_DIM = 128
BLOCK_SIZE = 16
MAX_GROUP = 8  # query heads per KV head (kMaxGroup in the source)
# Smaller decode batches stay on Triton: there a step's few programs each wait out a chain of
# latencies the kernel's four warps, merge and block-sized copies only lengthen (batch 1 on an H100,
# an earlier build of this kernel: 0.99 ms per output token against 0.84 with Triton).
MIN_SEQS = 16
_DTYPES = {torch.float16: 0, torch.bfloat16: 1}
_ERROR_BYTES = 512


def load_library(path: str) -> ctypes.CDLL:
    """A built library, its entry point typed."""
    lib = ctypes.CDLL(path)
    fn = lib.minivllm_fp8_decode
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, i64, i64, i32, i32, i32, i32, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                   ptr, i64, ptr, ptr, ptr, ctypes.c_float, i32, ptr, ptr, ptr, i32, i32, ptr, ctypes.c_char_p, i32]
    fn.restype = i32
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built (said once, in the log)."""
    return library_or_none(SOURCE, "minivllm_fp8_decode", "FP8 decode attention kernel", load_library,
                           "FP8 decode stays on Triton")


def serves(dtype: torch.dtype, num_heads: int, layout: KVCacheLayout, device: torch.device) -> bool:
    """Whether this model's decode steps over this cache suit the kernel (not whether it built)."""
    return (ENABLED and device.type == "cuda" and layout.fp8 and dtype in _DTYPES
            and layout.head_dim == HEAD_DIM and layout.block_size == BLOCK_SIZE
            and num_heads % layout.num_kv_heads == 0 and num_heads // layout.num_kv_heads <= MAX_GROUP
            and torch.cuda.get_device_capability(device) == (9, 0))


def supports(query: torch.Tensor, layout: KVCacheLayout, num_seqs: int) -> bool:
    """Whether a step of num_seqs sequences goes to the kernel: a decode-only step (query [num_seqs,
    num_heads, head_dim]), or a mixed step's decodes (decode's `mixed`)."""
    return (num_seqs >= MIN_SEQS and serves(query.dtype, query.shape[1], layout, query.device)
            and query.stride(2) == 1 and library() is not None)


def _check_views(views: KVCacheViews) -> None:
    key, value, key_scale, value_scale = views
    block_bytes = key.stride(0)
    # (16-byte copies: key rows, a head's value run and its 16 scales start on 16-byte boundaries)
    if (key.stride(3) != 1 or any(x % 16 for x in key.stride()[:3]) or value.stride(0) != block_bytes
            or value.stride(3) != 1 or value.stride(1) != HEAD_DIM or value.stride(2) % 16
            or key_scale.dtype != torch.bfloat16 or key_scale.stride() != value_scale.stride()
            or key_scale.stride(1) != 1 or key_scale.stride(0) % 8 or key_scale.stride(2) % 8):
        raise ValueError(f"not kv_cache.py's FP8 layout: key strides {key.stride()}, value {value.stride()}, "
                         f"scales {key_scale.stride()}")


def decode(query: torch.Tensor, views: KVCacheViews, layout: KVCacheLayout, metadata: AttentionMetadata,
           scale: float, out: torch.Tensor, num_splits: int, seq_order: torch.Tensor | None,
           partial_out: torch.Tensor | None = None, partial_max: torch.Tensor | None = None,
           partial_sum: torch.Tensor | None = None, lib: ctypes.CDLL | None = None, mixed: bool = False) -> None:
    """Row i of out = sequence i's query heads attending its cached keys (supports() must hold). With
    num_splits > 1 it writes each split's partial state instead ([seq, head, split] maxima and sums
    in base 2, [seq, head, split, head_dim] unnormalized outputs), for triton_attention's
    _combine_splits_kernel. seq_order: the order the sequences start in (None: as they come).
    mixed: a step with prefill chunks; its one-token sequences' rows (metadata.query_start_loc) are
    attended, in one split, and the other rows are left alone.
    lib: another build of the kernel (load_library's), else library()."""
    _check_views(views)
    query_start_loc = metadata.query_start_loc if mixed else None
    num_seqs, num_heads = metadata.num_seqs, query.shape[1]
    if out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {query.dtype} with unit stride along head_dim, got {out.dtype} {out.stride()}")
    tables = metadata.block_tables
    for name, array in (("block_tables", tables), ("seq_lens", metadata.seq_lens), ("seq_order", seq_order),
                        ("query_start_loc", query_start_loc)):
        if array is not None and (array.dtype != torch.int32 or array.stride(-1) != 1):
            raise ValueError(f"{name} must be int32 with unit stride along its last dim, got {array.dtype} "
                             f"{array.stride()}")
    if num_splits > 1 and (partial_out is None or partial_max is None or partial_sum is None):
        raise ValueError("num_splits > 1 needs partial_out, partial_max and partial_sum")
    key, value, key_scale, value_scale = views
    error = ctypes.create_string_buffer(_ERROR_BYTES)
    status = (lib or library()).minivllm_fp8_decode(
        out.data_ptr(), out.stride(0), out.stride(1), query.data_ptr(), query.stride(0), query.stride(1),
        _DTYPES[query.dtype], num_seqs, layout.num_kv_heads, num_heads // layout.num_kv_heads,
        key.data_ptr(), value.data_ptr(), key_scale.data_ptr(), value_scale.data_ptr(),
        key.stride(0), key.stride(1), key.stride(2), value.stride(2), key_scale.stride(0), key_scale.stride(2),
        tables.data_ptr(), tables.stride(0), metadata.seq_lens.data_ptr(),
        seq_order.data_ptr() if seq_order is not None else None,
        query_start_loc.data_ptr() if query_start_loc is not None else None, scale * 1.4426950408889634, num_splits,
        *((t.data_ptr() for t in (partial_out, partial_max, partial_sum)) if num_splits > 1 else (None,) * 3),
        int(STAGGER), int(pdl.enabled(query.device)), torch.cuda.current_stream(query.device).cuda_stream, error,
        _ERROR_BYTES)
    if status != 0:
        raise RuntimeError(f"FP8 decode attention: {error.value.decode(errors='replace')}")
