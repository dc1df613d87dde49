"""The fused sampler's kernels (worker/fused_sampling.py: inverting each row's CDF, one random
number a row) against the Gumbel-max sampler they replaced (kept below as it was: one random number
per vocabulary position, argmax of the perturbed logits): the time of each at 1-256 rows of a 152k
vocabulary in a CUDA graph, and how often each draws each of a few live tokens against softmax.

    python3 benchmarks/sampler_kernels.py     # on the device machine
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for benchmarks.graph_timing

from benchmarks.graph_timing import graph_time_us
from minivllm.worker.fused_sampling import fused_sample_on_device

# ---------------------------------------------------------------- the Gumbel-max sampler it replaced

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


def gumbel_max_sample_on_device(logits, rows, temperature, seeds, out, chunk: int = 4096, block: int = 2048) -> None:
    """The replaced sampler, its per-row arguments on the device (int64 rows and seeds, float32
    temperatures)."""
    num_chunks = triton.cdiv(logits.shape[1], chunk)
    scores = torch.empty(len(rows), num_chunks, device=logits.device, dtype=torch.float32)
    indices = torch.empty(len(rows), num_chunks, device=logits.device, dtype=torch.int64)
    _gumbel_max_chunk_kernel[(len(rows), num_chunks)](
        logits, logits.stride(0), rows, temperature, seeds, scores, indices, logits.shape[1], num_chunks,
        CHUNK=chunk, BLOCK=block, num_warps=4)
    _best_chunk_kernel[(len(rows),)](scores, indices, rows, out, num_chunks, CHUNKS=triton.next_power_of_2(num_chunks))


# ---------------------------------------------------------------- the comparison


def main() -> None:
    vocab = 151936
    print("us a call in a CUDA graph, 152k vocabulary, bf16 logits")
    print(f"{'rows':>5} {'temperature':>12} {'greedy equal':>13} {'Gumbel-max':>11} {'CDF':>8}")
    for batch in (1, 8, 64, 256):
        logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16) * 3
        rows = torch.arange(batch, device="cuda")
        seeds = torch.from_numpy(np.random.default_rng(batch).integers(0, 2**31 - 1, size=batch)).cuda()
        for label, value in (("1.0", 1.0), ("0 (greedy)", 0.0)):
            temperature = torch.full((batch,), value, device="cuda")
            old = torch.full((batch,), -1, device="cuda", dtype=torch.int64)
            new = torch.full((batch,), -1, device="cuda", dtype=torch.int64)
            gumbel_max_sample_on_device(logits, rows, temperature, seeds, old)
            fused_sample_on_device(logits, rows, temperature, seeds, new)
            same = str(bool((old == new).all())) if value == 0.0 else "-"
            t_old = graph_time_us(lambda: gumbel_max_sample_on_device(logits, rows, temperature, seeds, old), calls=20)
            t_new = graph_time_us(lambda: fused_sample_on_device(logits, rows, temperature, seeds, new), calls=20)
            print(f"{batch:>5} {label:>12} {same:>13} {t_old:>11.1f} {t_new:>8.1f}")
    # Both against softmax: 8 live tokens (the rest of a 152k row far below), 200k draws each.
    torch.manual_seed(0)
    live = torch.tensor([5, 4095, 4096, 30_000, 77_777, 100_001, 151_551, 151_935])
    row = torch.full((vocab,), -1e4, device="cuda")
    row[live] = torch.randn(len(live), device="cuda")
    expected = torch.softmax(row[live].double() / 0.7, -1).cpu()
    draws = 200_000
    rows, temperature = torch.arange(2048, device="cuda"), torch.full((2048,), 0.7, device="cuda")
    for name, fn in (("Gumbel-max", gumbel_max_sample_on_device), ("CDF", fused_sample_on_device)):
        counts = torch.zeros(vocab, dtype=torch.float64)
        for start in range(0, draws, 2048):
            out = torch.empty(2048, device="cuda", dtype=torch.int64)
            fn(row.expand(2048, vocab).contiguous(), rows, temperature, rows + start, out)
            counts += torch.bincount(out.cpu(), minlength=vocab).double()
        total = counts.sum().item()
        observed = counts[live] / total
        chi2 = (((observed - expected) * total) ** 2 / (expected * total)).sum().item()
        print(f"{name}: chi-square {chi2:.1f} at 7 degrees of freedom (p = 0.001 at 24.3); largest |observed - "
              f"expected| {(observed - expected).abs().max().item():.5f}")


if __name__ == "__main__":
    main()
