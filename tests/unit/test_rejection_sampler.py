"""The rejection sampler keeps the target distribution exactly; the n-gram proposer finds the most
recent earlier occurrence of the longest suffix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from minivllm.worker.sampler import Sampler, SamplingMetadata
from minivllm.worker.spec_decode.ngram_proposer import NgramProposer
from minivllm.worker.spec_decode.rejection_sampler import rejection_sample, verify_against_samples

TARGET = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
DRAFT = torch.tensor([0.3, 0.05, 0.3, 0.05, 0.2, 0.1])


def test_greedy_verification_accepts_while_drafts_equal_the_argmax() -> None:
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(dim=-1).tolist()
    # Request 0: 3 drafts, the first two right; request 1: no drafts; request 2: 1 draft, right.
    drafts = [[argmax[0], argmax[1], (argmax[2] + 1) % 50], [], [argmax[5]]]
    accepted, next_tokens = verify_against_samples(argmax, drafts)
    assert accepted == [[argmax[0], argmax[1]], [], [argmax[5]]]
    assert next_tokens == [argmax[2], argmax[4], argmax[6]]  # the correction, a plain sample, a bonus
    with pytest.raises(ValueError):
        verify_against_samples(argmax[:-1], drafts)


def first_token_histogram(accepted: list[list[int]], next_tokens: list[int], vocab: int) -> np.ndarray:
    first = [a[0] if a else t for a, t in zip(accepted, next_tokens)]
    return np.bincount(first, minlength=vocab)


def assert_follows(counts: np.ndarray, probs: torch.Tensor) -> None:
    expected = probs.double().numpy() / probs.double().sum().item() * counts.sum()
    assert chisquare(counts, expected).pvalue > 1e-3, (counts, expected)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_rejection_sampler_keeps_the_target_distribution(with_draft_probs: bool) -> None:
    """Drafts drawn from DRAFT (or one fixed one-hot draft), verified against TARGET: the first
    output token follows TARGET, and so does the second when the first was accepted."""
    n, vocab = 20000, len(TARGET)
    gen = torch.Generator().manual_seed(1)
    if with_draft_probs:
        first = torch.multinomial(DRAFT, n, replacement=True, generator=gen)
        second = torch.multinomial(DRAFT, n, replacement=True, generator=gen)
        draft_probs = DRAFT.repeat(2 * n, 1)
    else:
        first = torch.full((n,), 3)
        second = torch.full((n,), 1)
        draft_probs = None
    drafts = torch.stack([first, second], dim=1).tolist()
    target = TARGET.repeat(3 * n, 1)
    accepted, next_tokens = rejection_sample(target, drafts, draft_probs, generator=gen)
    assert_follows(first_token_histogram(accepted, next_tokens, vocab), TARGET)
    # Given the first draft was accepted, the second output token is again a TARGET sample.
    seconds = [a[1] if len(a) > 1 else t for a, t in zip(accepted, next_tokens) if len(a) >= 1]
    assert_follows(np.bincount(seconds, minlength=vocab), TARGET)
    rate = sum(len(a) > 0 for a in accepted) / n
    expected_rate = float(torch.minimum(TARGET, DRAFT).sum()) if with_draft_probs else float(TARGET[3])
    assert abs(rate - expected_rate) < 0.02


def test_sampled_verification_keeps_the_target_distribution_with_the_engine_sampler() -> None:
    """The engine's path for one-hot drafts: the ordinary sampler draws a target token at every
    position (temperature, top-k applied), and drafts are accepted while they equal it."""
    n, vocab = 20000, len(TARGET)
    logits = TARGET.log().repeat(2 * n, 1) * 2.0  # temperature 2 undoes the doubling
    metadata = SamplingMetadata.from_arrays(np.full(2 * n, 2.0, dtype=np.float32), np.zeros(2 * n, dtype=np.int64),
                                            np.ones(2 * n, dtype=np.float32), [None] * (2 * n), "cpu")
    sampled = Sampler(torch.Generator().manual_seed(2))(logits, metadata).tolist()
    accepted, next_tokens = verify_against_samples(sampled, [[3]] * n)
    assert_follows(first_token_histogram(accepted, next_tokens, vocab), TARGET)
    assert abs(sum(map(len, accepted)) / n - float(TARGET[3])) < 0.02


def test_rejection_sampler_is_reproducible_with_a_seed() -> None:
    target = torch.softmax(torch.randn(12, 30, generator=torch.Generator().manual_seed(3)), dim=-1)
    drafts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    results = [rejection_sample(target, drafts, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert results[0] == results[1]


def test_ngram_proposer_prefers_the_longest_then_the_latest_match() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    tokens = np.array([1, 2, 3, 4, 9, 9, 2, 3, 5, 6, 1, 2, 3])
    assert proposer.propose(tokens) == [4, 9, 9]  # "1 2 3" beats the later "2 3"
    assert proposer.propose(np.array([5, 2, 3, 7, 8, 2, 3, 6, 0, 2, 3])) == [6, 0, 2]  # the latest "2 3"
    assert proposer.propose(np.array([1, 2, 3])) == []
    assert proposer.propose(np.array([4, 5, 6, 7, 4]), max_drafts=2) == [5, 6]
    assert proposer.propose(np.array([4, 5, 6, 7, 4]), max_drafts=0) == []
    assert proposer.propose(np.array([1, 1, 1, 1])) == [1]  # the only match with a follower is at the end
    only_long = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=2)
    assert only_long.propose(np.array([7, 1, 8, 2, 9, 1])) == []  # a 1-gram match is not enough
    assert only_long.propose(np.array([7, 1, 8, 2, 7, 1])) == [8, 2]
