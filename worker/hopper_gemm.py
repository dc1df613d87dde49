"""y = x W^T for decode-sized batches on Hopper, in CUDA (hopper_gemm.cu), built with nvcc at worker start.

A decode step's projections are short products whose time cuBLAS spends mostly in fixed costs:
6-9 us each on an H100 at 64-256 rows (Qwen3-0.6B's shapes), against 1.4-4.2 us for their weights'
bytes. This kernel computes y^T = W x^T: weight rows fill wgmma's 64-row side, the step's tokens
its other side (tiles of 16-256). It launches with PDL (worker/pdl.py): one thread copies the CTA's
weight chunks by TMA before the kernel ahead has finished (weights depend on nothing), another waits
for that kernel before copying the activations, and two consumer warpgroups multiply alternate
64-wide chunks of K, then add their sums. For the MLP's gate|up projection it can return
silu(gate) * up directly (linear's silu_mul: a CTA's 64 rows are 32 gate rows and the same features'
32 up rows), so SiLU-and-mul's kernel and half the projection's output go. The kernels that feed it
(add + RMSNorm) launch with PDL where it follows them (starts_early), so its weights load under
their tails.

Where it pays is measured, not assumed (benchmarks/RESULTS.md, 2026-11-27, fifteenth session).
For an attention layer's qkv projection, linear_rope's epilogue also does ops.norm_rope's work:
each CTA takes one head's 128 rows, norms (Qwen3) and rotates the q and k heads in its output, and
stores this step's k and v in the paged KV cache (bf16, or e4m3 with scales), so that no kernel runs
between the projection and attention. On an H100 it beats the projection plus norm_rope at every
row count (FP8 cache, 256 rows: 11.3 against 15.0 us a layer; RESULTS.md, 2026-11-27, twenty-third
session). $MINIVLLM_HOPPER_GEMM_ROPE=0 keeps norm_rope (for measuring), =fp8 uses it for FP8 caches only.

It serves bfloat16 products without bias on compute capability 9.0, from MIN_ROWS to MAX_ROWS
rows, with N and K multiples of 64 and at most MAX_WEIGHT_BYTES of weights; everything else stays
on cuBLAS. No nvcc, or a failed build: the worker logs why once and stays on cuBLAS.
$MINIVLLM_HOPPER_GEMM=0 keeps cuBLAS, $MINIVLLM_HOPPER_GEMM_SILU_MUL=0 runs SiLU-and-mul as its own
kernel (both for measuring).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import NamedTuple

import torch

from minivllm.worker import pdl
from minivllm.worker.attention.cuda_build import library_or_none
from minivllm.worker.attention.kv_cache import KVCacheLayout

ENABLED = os.environ.get("MINIVLLM_HOPPER_GEMM", "1") != "0"
SILU_MUL = os.environ.get("MINIVLLM_HOPPER_GEMM_SILU_MUL", "1") != "0"
ROPE = os.environ.get("MINIVLLM_HOPPER_GEMM_ROPE", "1")  # "0": off; "fp8": for FP8 caches only
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hopper_gemm.cu")
MIN_ROWS = 2  # one row is small_batch_gemm's GEMV
MAX_ROWS = 256
# Projections with more weight than this stay on cuBLAS: the tiling was measured only on Qwen3-0.6B's
# shapes (4-12 MiB of weights), where a decode step's products are mostly fixed cost. Bigger ones
# (a 1.7B model's gate|up, 48 MiB) are more nearly bandwidth- or compute-bound, where cuBLAS's
# tiles have not been measured against these.
MAX_WEIGHT_BYTES = 16 << 20
TOKEN_TILES = tuple(range(16, 257, 16))  # the source instantiates each (with few or with all weight stages)
ROPE_TOKEN_TILES = tuple(range(16, 129, 16))  # and these for linear_rope (kMaxRopeTile)
HEAD_DIM = 128  # linear_rope's heads
_ERROR_BYTES = 512


class Tiling(NamedTuple):
    token_tile: int
    many_stages: bool  # as many weight stages as fit beside the activation ring, else 8


class RopeParams(ctypes.Structure):
    """hopper_gemm.cu's RopeParams, field for field. Cache strides in elements of the cache's type."""
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "positions", "slot_mapping", "cos_cache", "sin_cache", "q_norm", "k_norm", "k_cache", "v_cache", "k_scale",
        "v_scale")] + [(name, ctypes.c_int64) for name in (
            "block_stride", "k_slot_stride", "k_head_stride", "v_slot_stride", "v_head_stride",
            "scale_block_stride", "scale_slot_stride", "scale_head_stride")] + [
        ("eps", ctypes.c_float)] + [
        (name, ctypes.c_int) for name in ("num_q_heads", "num_kv_heads", "block_size", "fp8")]


def load_library(path: str) -> ctypes.CDLL:
    """A built library, its entry point typed."""
    lib = ctypes.CDLL(path)
    fn = lib.minivllm_hopper_gemm
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, i32, i32, i32, i32, i32, i32, i32, ptr, ctypes.c_char_p, i32]
    fn.restype = i32
    rope = lib.minivllm_hopper_gemm_rope
    rope.argtypes = [ptr, i64, ptr, i64, ptr, i64, i32, i32, i32, i32, ctypes.POINTER(RopeParams), i32, ptr,
                     ctypes.c_char_p, i32]
    rope.restype = i32
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built (said once, in the log)."""
    return library_or_none(SOURCE, "minivllm_hopper_gemm", "Hopper decode GEMM", load_library,
                           "decode projections stay on cuBLAS")


@functools.cache
def _device_serves(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0) and library() is not None


def supports(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None) -> bool:
    """Whether y = x weight^T goes to the kernel: x [M, K] with MIN_ROWS <= M <= MAX_ROWS."""
    return (ENABLED and weight is not None and bias is None and x.is_cuda and x.dim() == 2
            and MIN_ROWS <= x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.shape[0] % 64 == 0 and weight.shape[1] % 64 == 0
            and weight.numel() * weight.element_size() <= MAX_WEIGHT_BYTES
            and x.shape[1] == weight.shape[1] and x.stride(1) == 1 and weight.stride(1) == 1
            and x.stride(0) % 8 == 0 and weight.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and _device_serves(x.device.index or 0))


def starts_early(x: torch.Tensor) -> bool:
    """Whether the kernel launched before a projection of x (rows of the step) should let it start
    early (PDL): only where that projection is this kernel's, which loads its weights meanwhile."""
    return (ENABLED and pdl.enabled(x.device) and MIN_ROWS <= x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16
            and _device_serves(x.device.index or 0))


def tiling(num_tokens: int, n: int, k: int, num_sms: int) -> Tiling:
    """As many token tiles as fit one wave of CTAs beside the n / 64 row tiles, the tokens split
    evenly among them, in tiles of a multiple of 16 (a decode step's padded batch then fills them:
    with 96 rows past the end, which TMA fills with zeros, a 256-token tile ran 1.4x as long as
    full), and of at least
    32 tokens past 64 rows. All the weight stages that fit where K is long or the tiles are small;
    few where K is short and the tiles wide, which leaves room for the next kernel's CTAs. On an
    H100, at 2-256 rows of Qwen3-0.6B's four shapes, this is the fastest of the tilings around it
    or within ~0.4 us of it (benchmarks/results/2026-11-27-hopper-gemm/gemm_probe3.txt)."""
    token_tiles = max(1, num_sms // (n // 64))
    tokens_per_tile = -(-num_tokens // token_tiles)
    tile = min(TOKEN_TILES[-1], -(-tokens_per_tile // 16) * 16)
    if num_tokens > 64:
        tile = max(tile, 32)
    return Tiling(tile, k > 1024 or num_tokens <= 64)


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
           how: Tiling | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T -> [T, N] (bf16; see supports()). With silu_mul, weight is a fused
    gate | up projection (N / 2 rows each) and the result silu(x gate^T) * (x up^T) [T, N / 2], taken
    from the float sums in the kernel's epilogue (ops.silu_and_mul takes it from their bf16
    rounding). `how` overrides the tiling."""
    lib = library()
    num_tokens, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(num_tokens, n // 2 if silu_mul else n, dtype=x.dtype, device=x.device)
    if how is None:
        how = tiling(num_tokens, n, k, pdl.num_sms(x.device.index or 0))
    error = ctypes.create_string_buffer(_ERROR_BYTES)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    rc = lib.minivllm_hopper_gemm(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), weight.data_ptr(),
                                  weight.stride(0), num_tokens, n, k, how.token_tile, int(how.many_stages),
                                  int(silu_mul), int(pdl.enabled(x.device)), stream, error, _ERROR_BYTES)
    if rc != 0:
        raise RuntimeError(f"hopper_gemm: {error.value.decode()}")
    return out


class QkvRope(NamedTuple):
    """What linear_rope's epilogue needs besides the product: the step's positions and slots (int64,
    one per row), RoPE's cos/sin tables [max_position, 64] (fp32), Qwen3's q/k norm weights (None:
    none), the head counts, and the layer's KV cache with its layout."""
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    num_q_heads: int
    num_kv_heads: int
    kv_cache: torch.Tensor
    layout: KVCacheLayout


def supports_rope(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, rope: QkvRope) -> bool:
    """Whether linear_rope serves this qkv projection: supports() holds, heads of 128 dims rotated
    whole, int64 positions and slots, and a bf16 or FP8 cache ($MINIVLLM_HOPPER_GEMM_ROPE=fp8: FP8 only)."""
    layout = rope.layout
    return (ROPE != "0" and (layout.fp8 or ROPE != "fp8") and supports(x, weight, bias)
            and layout.head_dim == HEAD_DIM and weight.shape[0] == (rope.num_q_heads + 2 * rope.num_kv_heads) * HEAD_DIM
            and rope.cos_cache.shape[-1] == HEAD_DIM // 2
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (rope.cos_cache, rope.sin_cache))
            and all(t.dtype == torch.int64 and t.is_contiguous() and t.shape[0] == x.shape[0]
                    for t in (rope.positions, rope.slot_mapping))
            and all(t is None or (t.dtype == torch.bfloat16 and t.is_contiguous() and t.shape[0] == HEAD_DIM)
                    for t in (rope.q_norm, rope.k_norm))
            and (layout.fp8 or layout.dtype == torch.bfloat16))


def rope_token_tile(num_tokens: int, num_heads: int, num_sms: int) -> int:
    """linear_rope's token tile: tiling()'s rule with a CTA per head (128 rows), in tiles of at most 128."""
    token_tiles = max(1, num_sms // num_heads)
    tile = min(ROPE_TOKEN_TILES[-1], -(-(-(-num_tokens // token_tiles)) // 16) * 16)
    return max(tile, 32) if num_tokens > 64 else tile


def linear_rope(x: torch.Tensor, weight: torch.Tensor, rope: QkvRope, out: torch.Tensor | None = None,
                token_tile: int | None = None) -> torch.Tensor:
    """qkv [T, N] = x [T, K] @ weight [N, K]^T (N = (q heads + 2 kv heads) x 128, see supports_rope)
    with q and k as ops.norm_rope leaves them (normed, rotated) and this step's k and v written to
    rope.kv_cache at rope.slot_mapping, as norm_rope's kv_store would. token_tile overrides the rule's."""
    lib = library()
    num_tokens, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    if token_tile is None:
        token_tile = rope_token_tile(num_tokens, n // HEAD_DIM, pdl.num_sms(x.device.index or 0))
    views = rope.layout.split(rope.kv_cache)
    key, value = views.key, views.value
    if key.stride(3) != 1 or value.stride(3) != 1 or key.stride(0) != value.stride(0):
        raise ValueError(f"not kv_cache.py's layout: key strides {key.stride()}, value {value.stride()}")
    scale_strides = views.key_scale.stride() if views.key_scale is not None else (0, 0, 0)

    def address(t: torch.Tensor | None) -> int | None:
        return t.data_ptr() if t is not None else None

    params = RopeParams(
        address(rope.positions), address(rope.slot_mapping), address(rope.cos_cache), address(rope.sin_cache),
        address(rope.q_norm), address(rope.k_norm), key.data_ptr(), value.data_ptr(), address(views.key_scale),
        address(views.value_scale), key.stride(0), key.stride(1), key.stride(2), value.stride(1), value.stride(2),
        *scale_strides, rope.eps, rope.num_q_heads, rope.num_kv_heads, rope.layout.block_size,
        int(rope.layout.fp8))
    error = ctypes.create_string_buffer(_ERROR_BYTES)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    rc = lib.minivllm_hopper_gemm_rope(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), weight.data_ptr(),
                                       weight.stride(0), num_tokens, n, k, token_tile, ctypes.byref(params),
                                       int(pdl.enabled(x.device)), stream, error, _ERROR_BYTES)
    if rc != 0:
        raise RuntimeError(f"hopper_gemm: {error.value.decode()}")
    return out
