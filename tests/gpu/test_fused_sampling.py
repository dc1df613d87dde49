"""The fused CUDA sampler: exact greedy, the right distribution, reproducible seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="needs Triton (the CUDA build of torch)")
from minivllm.worker.fused_sampling import fused_sample, row_seeds  # noqa: E402
from minivllm.worker.sampler import Sampler  # noqa: E402


def sample(logits, temperature, seeds):
    out = torch.empty(logits.shape[0], dtype=torch.int64, device="cuda")
    fused_sample(logits, np.arange(logits.shape[0]), np.asarray(temperature), np.asarray(seeds), out)
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


def test_distribution_holds_across_blocks_and_chunks() -> None:
    """The first kernel sums each chunk's mass, the second finds the chunk and then the token in
    it: ten live tokens spread over blocks and chunks (the rest of the row far below, one NaN, one
    -inf) are drawn with softmax's probabilities."""
    torch.manual_seed(1)
    vocab = 12_000
    live = torch.tensor([3, 600, 1100, 1700, 2047, 2048, 2600, 4095, 4096, 9999])
    logits = torch.full((1, vocab), -1e4, device="cuda")
    logits[0, live] = torch.randn(len(live), device="cuda")
    logits[0, 5000], logits[0, 7000] = float("nan"), float("-inf")
    draws = 20_000
    tokens = sample(logits.expand(draws, vocab).contiguous(), np.ones(draws), np.arange(draws)).cpu()
    assert bool(torch.isin(tokens, live).all())
    observed = torch.bincount(tokens, minlength=vocab)[live].double()
    expected = torch.softmax(logits[0, live].double(), -1).cpu() * draws
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 27.9  # p = 0.001 at 9 degrees of freedom


def test_inversion_lands_on_live_tokens_only() -> None:
    """Rows with one live token (the rest -inf, NaN or far below), at chunk and block edges and at
    the end of a vocabulary that is not a multiple of the chunk: the draw is that token, whatever
    the uniform; a near-zero temperature draws the argmax."""
    vocab = 151_936
    positions = [0, 2047, 2048, 4095, 4096, 77_777, vocab - 385, vocab - 384, vocab - 1]
    logits = torch.full((len(positions) + 1, vocab), float("-inf"), device="cuda")
    for row, position in enumerate(positions):
        logits[row, position] = 3.0
    logits[1, 5] = float("nan")
    logits[2, :100] = -1e30  # live, but no mass beside the token at 2048 once scaled
    logits[-1] = torch.randn(vocab, device="cuda")
    draws = sample(logits, np.r_[np.ones(len(positions)), 1e-4], np.arange(len(positions) + 1) + 11)
    assert draws[:-1].tolist() == positions
    assert draws[-1].item() == logits[-1].argmax().item()


def test_two_tokens_across_a_chunk_edge_split_evenly() -> None:
    """Equal logits at the last position of one chunk and the first of the next: each half the
    time (the chunk masses and the scan inside a chunk must agree on where the mass lies)."""
    vocab = 9_000
    logits = torch.full((1, vocab), -50.0, device="cuda")
    logits[0, [4095, 4096]] = 10.0
    draws = 20_000
    tokens = sample(logits.expand(draws, vocab).contiguous(), np.ones(draws), np.arange(draws)).cpu()
    assert bool(torch.isin(tokens, torch.tensor([4095, 4096])).all())
    fraction = (tokens == 4095).double().mean().item()
    assert abs(fraction - 0.5) < 0.015  # ~4.2 standard deviations at 20k draws


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
