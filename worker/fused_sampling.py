"""One-kernel sampling on CUDA for the rows that need no top-k/top-p: greedy or plain temperature.

Gumbel-max: argmax_i(logits_i / T + G_i), G_i = -log(-log U_i) with U_i uniform, picks token i with
probability softmax(logits / T)_i, so a single pass over the logits samples exactly, with no
softmax, no fp32 copy and no noise tensor in memory. The random bits come from Triton's
counter-based Philox generator keyed by (row seed, vocabulary position), each call giving four
positions' worth: a request with a `seed` gets row seeds derived from its seed and its token count,
so its tokens do not depend on the rest of the batch. Temperature 0 rows take the plain argmax.

Computing the noise, not reading the logits, is this kernel's cost: with one Philox call per
position and libdevice's logs it took 203 us for 256 rows of a 152k vocabulary on an H100 (a
decode step of that batch is ~5.5-9 ms); one call per four positions and the hardware's log2
approximation take it to ~85 us (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

SEED_MODULUS = 2**31 - 1


@triton.jit
def _fast_log2(x):
    """lg2.approx.f32: log2 to ~2^-22 absolute, a fraction of libdevice's instructions."""
    return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _gumbel_log2(bits):
    """G / ln 2 for a Gumbel G = -ln(E), E = -ln(U) ~ Exp(1), from 32 random bits.

    The largest noise comes from the smallest E, so E is made accurate in relative terms there:
    with V = 1 - U taken straight from the bits (fine-grained near 0), E = -ln(1 - V) is V's
    series while V is small, where 1 - V would round away V's low bits, and the log elsewhere.
    """
    v = tl.minimum((bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.99999994)
    series = v * (1.0 + v * (0.5 + v * 0.33333334))  # -ln(1 - v) to ~v^3/4 relative below 2^-6
    e = tl.where(v < 0.015625, series, -0.6931471805599453 * _fast_log2(1.0 - v))
    return -_fast_log2(e)


@triton.jit
def _block_best(logits_row, start, vocab_size, BLOCK: tl.constexpr):
    """The largest logit among positions start .. start + BLOCK - 1 of a row, and its position (the
    earliest on a tie): a greedy row's share of a block."""
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(logits_row + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
    return tl.max(x, axis=0), start + tl.argmax(x, axis=0, tie_break_left=True)


@triton.jit
def _noisy_block_best(logits_row, start, seed, scale, vocab_size, BLOCK: tl.constexpr):
    """The best Gumbel-perturbed score (base 2: logit * scale + G / ln 2, scale = log2(e) / T) among
    positions start .. start + BLOCK - 1 of a row, and its position (the earliest on a tie, which
    noise makes all but impossible). One Philox call gives four draws, so the block is taken as four
    quarters, each with one of the four; the counter is unique per position of the row."""
    QUARTER: tl.constexpr = BLOCK // 4
    j = tl.arange(0, QUARTER)
    bits0, bits1, bits2, bits3 = tl.randint4x(seed, start // 4 + j)
    offs0 = start + j
    offs1 = offs0 + QUARTER
    offs2 = offs1 + QUARTER
    offs3 = offs2 + QUARTER
    # (out-of-vocabulary positions load -inf and stay -inf: the noise is finite)
    s0 = tl.load(logits_row + offs0, mask=offs0 < vocab_size, other=float("-inf")).to(tl.float32) * scale \
        + _gumbel_log2(bits0)
    s1 = tl.load(logits_row + offs1, mask=offs1 < vocab_size, other=float("-inf")).to(tl.float32) * scale \
        + _gumbel_log2(bits1)
    s2 = tl.load(logits_row + offs2, mask=offs2 < vocab_size, other=float("-inf")).to(tl.float32) * scale \
        + _gumbel_log2(bits2)
    s3 = tl.load(logits_row + offs3, mask=offs3 < vocab_size, other=float("-inf")).to(tl.float32) * scale \
        + _gumbel_log2(bits3)
    best = tl.maximum(tl.maximum(tl.max(s0, axis=0), tl.max(s1, axis=0)),
                      tl.maximum(tl.max(s2, axis=0), tl.max(s3, axis=0)))
    past = vocab_size + BLOCK
    index = tl.minimum(tl.minimum(tl.min(tl.where(s0 == best, offs0, past), axis=0),
                                  tl.min(tl.where(s1 == best, offs1, past), axis=0)),
                       tl.minimum(tl.min(tl.where(s2 == best, offs2, past), axis=0),
                                  tl.min(tl.where(s3 == best, offs3, past), axis=0)))
    return best, index


@triton.jit
def _gumbel_max_chunk_kernel(logits_ptr, stride_row, rows_ptr, temperature_ptr, seeds_ptr,
                             chunk_score_ptr, chunk_index_ptr, vocab_size, num_chunks,
                             CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, c): the best Gumbel-perturbed score of row i within vocabulary chunk c (base-2
    units, _noisy_block_best; temperature-0 rows: the plain logits)."""
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(rows_ptr + i)
    temperature = tl.load(temperature_ptr + i)
    seed = tl.load(seeds_ptr + i)
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    best_score = float("-inf")
    best_index = 0
    # (ties keep the earlier index, as one pass over the row would)
    if temperature == 0.0:
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            block_best, block_index = _block_best(logits_row, start, vocab_size, BLOCK)
            better = block_best > best_score
            best_index = tl.where(better, block_index, best_index)
            best_score = tl.where(better, block_best, best_score)
    else:
        scale = 1.4426950408889634 / temperature
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            block_best, block_index = _noisy_block_best(logits_row, start, seed, scale, vocab_size, BLOCK)
            better = block_best > best_score
            best_index = tl.where(better, block_index, best_index)
            best_score = tl.where(better, block_best, best_score)
    tl.store(chunk_score_ptr + i * num_chunks + chunk, best_score)
    tl.store(chunk_index_ptr + i * num_chunks + chunk, best_index)


@triton.jit
def _best_chunk_kernel(chunk_score_ptr, chunk_index_ptr, rows_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr):
    """Program i: row i's token is the best of its chunks' bests (the earliest on a tie)."""
    i = tl.program_id(0)
    offs = tl.arange(0, CHUNKS)
    scores = tl.load(chunk_score_ptr + i * num_chunks + offs, mask=offs < num_chunks, other=float("-inf"))
    best = tl.argmax(scores, axis=0, tie_break_left=True)
    tl.store(out_ptr + tl.load(rows_ptr + i), tl.load(chunk_index_ptr + i * num_chunks + best))


# One program per row walking a 152k vocabulary took ~150 us at batch 1 (one SM busy); chunks of
# the row run side by side, and a second tiny kernel picks each row's best. (H100, 152k vocabulary,
# temperature 1: 4,096-wide chunks 7.3 us at 1 row against 11.1 at 8,192; the same at 256 rows.)
_CHUNK = 4096
_BLOCK = 2048


def gumbel_max_sample(logits: torch.Tensor, rows: np.ndarray, temperature: np.ndarray, seeds: np.ndarray,
                      out: torch.Tensor) -> None:
    """Sample out[rows] from logits[rows] (any float dtype) at their temperatures."""
    device = logits.device

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)

    gumbel_max_sample_on_device(logits, to_device(rows.astype(np.int64)), to_device(temperature.astype(np.float32)),
                                to_device(seeds.astype(np.int64)), out)


def gumbel_max_sample_on_device(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                                seeds: torch.Tensor, out: torch.Tensor) -> None:
    """gumbel_max_sample with its per-row arguments already on the device (int64 rows and seeds,
    float32 temperatures): no host work but the two launches, so a CUDA graph can hold it."""
    vocab_size = logits.shape[1]
    num_chunks = triton.cdiv(vocab_size, _CHUNK)
    num_rows = rows.shape[0]
    chunk_scores = torch.empty(num_rows, num_chunks, device=logits.device, dtype=torch.float32)
    chunk_indices = torch.empty(num_rows, num_chunks, device=logits.device, dtype=torch.int64)
    _gumbel_max_chunk_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), rows, temperature, seeds, chunk_scores, chunk_indices, vocab_size, num_chunks,
        CHUNK=_CHUNK, BLOCK=_BLOCK, num_warps=4,
    )
    _best_chunk_kernel[(num_rows,)](chunk_scores, chunk_indices, rows, out, num_chunks,
                                    CHUNKS=triton.next_power_of_2(num_chunks))


def row_seeds(request_seeds: np.ndarray, num_tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Per-row Philox seeds: from (seed, token count) for requests with a seed, else fresh draws."""
    fresh = rng.integers(0, SEED_MODULUS, size=len(request_seeds))
    derived = (request_seeds * 1_000_003 + num_tokens) % SEED_MODULUS
    return np.where(request_seeds >= 0, derived, fresh)
