"""The one-kernel CUDA sampler: exact greedy, the right distribution, reproducible seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="needs Triton (the CUDA build of torch)")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from minivllm.worker.fused_sampling import _gumbel_log2, gumbel_max_sample, row_seeds  # noqa: E402
from minivllm.worker.sampler import Sampler  # noqa: E402


def sample(logits, temperature, seeds):
    out = torch.empty(logits.shape[0], dtype=torch.int64, device="cuda")
    gumbel_max_sample(logits, np.arange(logits.shape[0]), np.asarray(temperature), np.asarray(seeds), out)
    return out


def test_temperature_zero_is_argmax() -> None:
    logits = torch.randn(64, 151936, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(sample(logits, np.zeros(64), np.arange(64)), logits.float().argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_distribution_matches_softmax(temperature) -> None:
    """Chi-square against softmax(logits / T) over 20k draws of a 10-token vocabulary."""
    torch.manual_seed(0)
    logits = torch.randn(1, 10, device="cuda") * 2
    draws = 20_000
    tokens = sample(logits.expand(draws, 10).contiguous(), np.full(draws, temperature), np.arange(draws))
    observed = torch.bincount(tokens, minlength=10).double().cpu()
    expected = torch.softmax(logits[0].double() / temperature, -1).cpu() * draws
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 27.9  # p = 0.001 at 9 degrees of freedom


def test_distribution_holds_across_quarters_blocks_and_chunks() -> None:
    """The kernel takes each block of the vocabulary as four quarters, each with its own share of a
    Philox call, and the row in chunks: ten live tokens spread over all of them (the rest of the
    row far below) are drawn with softmax's probabilities."""
    torch.manual_seed(1)
    vocab = 12_000
    live = torch.tensor([3, 600, 1100, 1700, 2047, 2048, 2600, 4095, 4096, 9999])
    logits = torch.full((1, vocab), -1e4, device="cuda")
    logits[0, live] = torch.randn(len(live), device="cuda")
    draws = 20_000
    tokens = sample(logits.expand(draws, vocab).contiguous(), np.ones(draws), np.arange(draws)).cpu()
    assert bool(torch.isin(tokens, live).all())
    observed = torch.bincount(tokens, minlength=vocab)[live].double()
    expected = torch.softmax(logits[0, live].double(), -1).cpu() * draws
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 27.9  # p = 0.001 at 9 degrees of freedom


@triton.jit
def _noise_kernel(bits_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + offs, mask=offs < n).to(tl.uint32, bitcast=True)
    tl.store(out_ptr + offs, _gumbel_log2(bits), mask=offs < n)


def test_noise_is_accurate_where_it_is_largest() -> None:
    """The Gumbel noise from 32 random bits, against float64: the largest noise comes from U near 1,
    where -ln(U) computed from a rounded float32 U would be 0 or off by a whole quantum; the kernel
    takes it from V = 1 - U's bits (and a series) instead, and is accurate across the range."""
    bits = np.unique(np.concatenate([
        np.arange(0, 4096), 2 ** np.arange(12, 32), 2 ** np.arange(12, 32) - 1, 3 * 2 ** np.arange(12, 30),
        np.random.default_rng(0).integers(0, 2**32, 100_000), [2**32 - 1, 2**32 - 256, 2**26 - 1, 2**26 + 1],
    ]).astype(np.uint64)).astype(np.uint32)
    out = torch.empty(len(bits), device="cuda")
    _noise_kernel[(triton.cdiv(len(bits), 1024),)](torch.from_numpy(bits.view(np.int32)).cuda(), out, len(bits),
                                                   BLOCK=1024)
    v = np.minimum((bits.astype(np.float32).astype(np.float64) + 0.5) * 2.0**-32, np.float64(np.float32(0.99999994)))
    expected = -np.log2(-np.log1p(-v))  # G / ln 2 for E = -ln(1 - V)
    error = np.abs(out.cpu().double().numpy() - expected)
    assert error.max() < 5e-5, (bits[error.argmax()], error.max())
    assert expected.max() > 30  # (the range reached: V down to ~1e-10 gives noise ~33)


def test_seeded_rows_are_reproducible_and_batch_independent() -> None:
    rng = np.random.default_rng(0)
    logits = torch.randn(8, 1000, device="cuda")
    seeds = row_seeds(np.array([7] * 8), np.arange(8), rng)
    assert torch.equal(sample(logits, np.ones(8), seeds), sample(logits, np.ones(8), seeds))
    alone = sample(logits[3:4].contiguous(), np.ones(1), seeds[3:4])
    assert alone.item() == sample(logits, np.ones(8), seeds)[3].item()
    unseeded = row_seeds(np.full(8, -1), np.arange(8), rng)
    assert not np.array_equal(unseeded, row_seeds(np.full(8, -1), np.arange(8), rng))


def test_filtered_rows_take_the_torch_path() -> None:
    sampler = Sampler(torch.Generator(device="cuda").manual_seed(0))
    logits = torch.randn(4, 500, device="cuda")
    out = sampler.sample_rows(logits, np.array([0.0, 1.0, 1.0, 1.0], dtype=np.float32),
                              np.array([0, 1, 0, 0]), np.array([1.0, 1.0, 1e-6, 1.0], dtype=np.float32),
                              [None] * 4, np.arange(4), np.zeros(4, dtype=np.float32))
    top = logits.argmax(-1)
    assert out[0] == top[0] and out[1] == top[1] and out[2] == top[2]  # greedy, top_k=1, tiny top_p
