"""One-kernel sampling on CUDA for the rows that need no top-k/top-p: greedy or plain temperature.

Gumbel-max: argmax_i(logits_i / T + G_i), G_i = -log(-log U_i) with U_i uniform, picks token i with
probability softmax(logits / T)_i, so a single pass over the logits samples exactly, with no
softmax, no fp32 copy and no noise tensor in memory. The uniforms come from Triton's counter-based
Philox generator keyed by (row seed, vocabulary index): a request with a `seed` gets row seeds
derived from its seed and its token count, so its tokens do not depend on the rest of the batch.
Temperature 0 rows take the plain argmax.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

SEED_MODULUS = 2**31 - 1


@triton.jit
def _gumbel_max_chunk_kernel(logits_ptr, stride_row, rows_ptr, temperature_ptr, seeds_ptr,
                             chunk_score_ptr, chunk_index_ptr, vocab_size, num_chunks,
                             CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, c): the best Gumbel-perturbed score of row i within vocabulary chunk c."""
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(rows_ptr + i)
    temperature = tl.load(temperature_ptr + i)
    seed = tl.load(seeds_ptr + i)
    greedy = temperature == 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / temperature)
    best_score = float("-inf")
    best_index = 0
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab_size
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=mask, other=float("-inf"))
        score = x.to(tl.float32) * inv_t
        if not greedy:
            u = tl.rand(seed, offs)
            score += -tl.log(-tl.log(tl.maximum(u, 1e-12)))
        score = tl.where(mask, score, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_index = start + tl.argmax(score, axis=0)
        better = block_best > best_score  # ties keep the earlier index, as one pass over the row would
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
# the row run side by side, and a second tiny kernel picks each row's best.
_CHUNK = 8192
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
