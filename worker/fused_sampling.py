"""Fused sampling on CUDA, in two kernels, for the rows that need no top-k/top-p: greedy or plain temperature.

A row is sampled by inverting its CDF: with p = softmax(logits / T), the token is the first i whose
cumulative probability p_0 + ... + p_i exceeds a uniform U. That takes one random number per row.
The Gumbel-max sampler this replaced (argmax of logits / T plus Gumbel noise) drew one per
vocabulary position, and computing that noise, not reading the logits, was its cost: ~85 us for 256
rows of a 152k vocabulary on an H100 (benchmarks/sampler_kernels.py has it for comparison).

Two kernels, so that a row's vocabulary is read by many programs side by side:
- per (row, chunk of the vocabulary): the chunk's largest scaled logit m and its mass
  sum(exp2(s - m)), s = logit * log2(e) / T (an online softmax over the chunk's blocks), or, for
  a greedy row, its largest logit and where it is;
- per row: the chunks' masses on one scale, U times their total, the chunk where the cumulative
  mass passes that, then that chunk's logits again (4,096 of them) to find the token.
A row's random number comes from Triton's counter-based Philox generator keyed by the row's seed:
a request with a `seed` gets row seeds derived from its seed and its token count, so its tokens do
not depend on the rest of the batch. Temperature 0 rows take the plain argmax (the earliest on a
tie). NaN logits count as -inf (no mass); so do masked ones (-inf from logits processors).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

SEED_MODULUS = 2**31 - 1


@triton.jit
def _scaled_block(logits_row, start, scale, vocab_size, BLOCK: tl.constexpr):
    """Positions start .. start + BLOCK - 1 of a row and their logits times `scale` in float32
    (past the vocabulary, and NaN: -inf)."""
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(logits_row + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32) * scale
    return offs, tl.where(x == x, x, float("-inf"))


@triton.jit
def _chunk_mass_kernel(logits_ptr, stride_row, rows_ptr, temperature_ptr, chunk_max_ptr, chunk_mass_ptr,
                       chunk_index_ptr, vocab_size, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, c), row i's vocabulary chunk c: its largest scaled logit m (base 2, log2(e) / T
    times the logit) and its mass sum(exp2(s - m)); for a greedy row its largest logit and that
    logit's position (the earliest on a tie)."""
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(rows_ptr + i)
    temperature = tl.load(temperature_ptr + i)
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    best = float("-inf")
    if temperature == 0.0:
        best_index = 0
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            offs, x = _scaled_block(logits_row, start, 1.0, vocab_size, BLOCK)
            block_best = tl.max(x, axis=0)
            better = block_best > best  # (a tie keeps the earlier block's)
            best_index = tl.where(better, start + tl.argmax(x, axis=0, tie_break_left=True), best_index)
            best = tl.where(better, block_best, best)
        tl.store(chunk_index_ptr + i * num_chunks + chunk, best_index)
    else:
        scale = 1.4426950408889634 / temperature
        mass = 0.0
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            offs, s = _scaled_block(logits_row, start, scale, vocab_size, BLOCK)
            new_best = tl.maximum(best, tl.max(s, axis=0))
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # nothing live yet: no mass either
            mass = mass * tl.math.exp2(best - shift) + tl.sum(tl.math.exp2(s - shift), axis=0)
            best = new_best
        tl.store(chunk_mass_ptr + i * num_chunks + chunk, mass)
    tl.store(chunk_max_ptr + i * num_chunks + chunk, best)


@triton.jit
def _pick_kernel(logits_ptr, stride_row, rows_ptr, temperature_ptr, seeds_ptr, chunk_max_ptr, chunk_mass_ptr,
                 chunk_index_ptr, out_ptr, vocab_size, num_chunks, CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Program i: row i's token. Greedy: the chunk with the largest logit (the earliest on a tie),
    and its position there. Sampled: U in [0, 1) from the row's seed, target = U x the row's mass;
    the first chunk whose cumulative mass passes it, then the first position in that chunk whose
    cumulative probability passes what is left of it. (Rounding may leave the target at or past a
    chunk's own sum: then the chunk's last live position.)"""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    temperature = tl.load(temperature_ptr + i)
    chunks = tl.arange(0, CHUNKS)
    valid = chunks < num_chunks
    maxes = tl.load(chunk_max_ptr + i * num_chunks + chunks, mask=valid, other=float("-inf"))
    if temperature == 0.0:
        best = tl.argmax(maxes, axis=0, tie_break_left=True)
        token = tl.load(chunk_index_ptr + i * num_chunks + best)
    else:
        top = tl.max(maxes, axis=0)
        shift = tl.where(top == float("-inf"), 0.0, top)
        masses = tl.load(chunk_mass_ptr + i * num_chunks + chunks, mask=valid, other=0.0) * tl.math.exp2(maxes - shift)
        bits = tl.randint(tl.load(seeds_ptr + i), i * 0).to(tl.uint32, bitcast=True)  # counter 0
        uniform = (bits >> 8).to(tl.float32) * 5.960464477539063e-08  # 24 bits: [0, 1 - 2^-24]
        target = uniform * tl.sum(masses, axis=0)
        passed = (tl.cumsum(masses, axis=0) > target) & (masses > 0.0)
        live = tl.max(tl.where(masses > 0.0, chunks, 0), axis=0)
        chunk = tl.minimum(tl.min(tl.where(passed, chunks, CHUNKS), axis=0), live)
        left = tl.maximum(target - tl.sum(tl.where(chunks < chunk, masses, 0.0), axis=0), 0.0)
        scale = 1.4426950408889634 / temperature
        logits_row = logits_ptr + row.to(tl.int64) * stride_row
        past = vocab_size + CHUNK
        token = past
        last_live = 0
        below = 0.0  # the chunk's mass before this block
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            offs, s = _scaled_block(logits_row, start, scale, vocab_size, BLOCK)
            p = tl.math.exp2(s - shift)
            hit = (below + tl.cumsum(p, axis=0) > left) & (p > 0.0)
            token = tl.minimum(token, tl.min(tl.where(hit, offs, past), axis=0))
            last_live = tl.maximum(last_live, tl.max(tl.where(p > 0.0, offs, 0), axis=0))
            below += tl.sum(p, axis=0)
        token = tl.where(token == past, last_live, token).to(tl.int64)
    tl.store(out_ptr + row, token)


# A row's vocabulary in chunks, side by side: one program per row walking a 152k vocabulary took
# ~150 us at batch 1 (one SM busy). (H100, 152k vocabulary: 4,096-wide chunks 7.3 us at 1 row
# against 11.1 at 8,192, measured with the Gumbel-max kernel this replaced.)
_CHUNK = 4096
_BLOCK = 2048


def fused_sample(logits: torch.Tensor, rows: np.ndarray, temperature: np.ndarray, seeds: np.ndarray,
                 out: torch.Tensor) -> None:
    """Sample out[rows] from logits[rows] (any float dtype) at their temperatures."""
    device = logits.device

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)

    fused_sample_on_device(logits, to_device(rows.astype(np.int64)), to_device(temperature.astype(np.float32)),
                           to_device(seeds.astype(np.int64)), out)


def fused_sample_on_device(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                           seeds: torch.Tensor, out: torch.Tensor) -> None:
    """fused_sample with its per-row arguments already on the device (int64 rows and seeds,
    float32 temperatures): no host work but the two launches, so a CUDA graph can hold it."""
    vocab_size = logits.shape[1]
    num_chunks = triton.cdiv(vocab_size, _CHUNK)
    num_rows = rows.shape[0]
    chunk_max = torch.empty(num_rows, num_chunks, device=logits.device, dtype=torch.float32)
    chunk_mass = torch.empty(num_rows, num_chunks, device=logits.device, dtype=torch.float32)
    chunk_index = torch.empty(num_rows, num_chunks, device=logits.device, dtype=torch.int64)
    _chunk_mass_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), rows, temperature, chunk_max, chunk_mass, chunk_index, vocab_size, num_chunks,
        CHUNK=_CHUNK, BLOCK=_BLOCK, num_warps=4,
    )
    _pick_kernel[(num_rows,)](
        logits, logits.stride(0), rows, temperature, seeds, chunk_max, chunk_mass, chunk_index, out, vocab_size,
        num_chunks, CHUNKS=triton.next_power_of_2(num_chunks), CHUNK=_CHUNK, BLOCK=_BLOCK, num_warps=4,
    )


def row_seeds(request_seeds: np.ndarray, num_tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Per-row Philox seeds: from (seed, token count) for requests with a seed, else fresh draws."""
    fresh = rng.integers(0, SEED_MODULUS, size=len(request_seeds))
    derived = (request_seeds * 1_000_003 + num_tokens) % SEED_MODULUS
    return np.where(request_seeds >= 0, derived, fresh)
