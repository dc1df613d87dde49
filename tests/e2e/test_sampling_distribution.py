"""Sampling draws from the distribution it claims: a chi-squared goodness-of-fit test of the
sampled first tokens against softmax(logits / T) (after the top-p cut) computed with HF
transformers from the tiny model's logits. Each test also checks that it would notice a wrong
temperature, so it can fail.

Samples are independent seeded draws: through the CPU torch sampler directly (many rows of the
same logits), and through the whole engine (n seeded completions of one prompt, seeds seed + k).
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.worker.sampler import Sampler, SamplingMetadata, apply_top_k_top_p

PROMPT = "The quick brown fox"
ACCEPT_P = 1e-3  # the draws are seeded, so a pass is deterministic; this only sets how strict
REJECT_P = 1e-6  # a wrong temperature must be far out


@pytest.fixture(scope="module")
def next_token_logits(tiny_llama) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(tiny_llama)(PROMPT).input_ids
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def expected_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    scaled = logits / temperature
    if top_p < 1.0:
        scaled = apply_top_k_top_p(scaled[None], torch.tensor([0]), torch.tensor([top_p]))[0]
    return torch.softmax(scaled, dim=-1)


def chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test, tokens expected fewer than 5 times pooled into one bin. Tokens of
    probability 0 must never be drawn (checked separately)."""
    n = int(counts.sum())
    expected = probs.double() * n
    big = expected >= 5.0
    observed_bins = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    expected_bins = torch.cat([expected[big], expected[~big].sum()[None]])
    if expected_bins[-1] < 5.0:  # too small a pool: fold it into the smallest big bin
        observed_bins[-2] += observed_bins[-1]
        expected_bins[-2] += expected_bins[-1]
        observed_bins, expected_bins = observed_bins[:-1], expected_bins[:-1]
    statistic = ((observed_bins - expected_bins) ** 2 / expected_bins).sum()
    dof = len(expected_bins) - 1
    assert dof >= 3, "too few bins for a meaningful test; sample more or flatten the distribution"
    # The chi-squared survival function: the regularized upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2.0))


def check_fits(counts: torch.Tensor, logits: torch.Tensor, temperature: float, top_p: float,
               wrong_temperature: float) -> None:
    probs = expected_probs(logits, temperature, top_p)
    assert int(counts[probs == 0].sum()) == 0, "drew a token outside the top-p nucleus"
    p_value = chi2_p_value(counts, probs)
    assert p_value > ACCEPT_P, f"samples do not fit T={temperature}, top_p={top_p}: p={p_value:.2e}"
    # The same test must reject the distribution of another temperature.
    wrong = expected_probs(logits, wrong_temperature, top_p)
    wrong = torch.where(probs > 0, wrong, torch.zeros_like(wrong))
    wrong_p = chi2_p_value(counts, wrong / wrong.sum())
    assert wrong_p < REJECT_P, f"the test cannot tell T={temperature} from T={wrong_temperature}: p={wrong_p:.2e}"


@pytest.mark.parametrize("temperature, top_p, wrong_temperature", [(0.4, 1.0, 0.5), (1.0, 0.5, 1.3)])
def test_torch_sampler_matches_the_models_distribution(next_token_logits, temperature, top_p,
                                                       wrong_temperature) -> None:
    num_samples = 20000
    logits = next_token_logits[None].expand(num_samples, -1).contiguous()
    params = [SamplingParams(temperature=temperature, top_p=top_p)] * num_samples
    sampler = Sampler(torch.Generator().manual_seed(1234))
    tokens = sampler(logits, SamplingMetadata.from_params(params, [None] * num_samples, "cpu"))
    counts = torch.bincount(tokens, minlength=logits.shape[1])
    check_fits(counts, next_token_logits, temperature, top_p, wrong_temperature)


def test_engine_samples_match_the_models_distribution(tiny_llama, next_token_logits) -> None:
    """Through the whole engine: each of n seeded completions draws its first token with its own
    generator. Fewer samples, so a coarser (still clearly failing) wrong temperature."""
    temperature, num_requests, n = 0.4, 5, 120  # 600 samples; n is capped at 128 (OpenAI's limit)
    with LLM(tiny_llama, max_model_len=64, max_num_seqs=256) as llm:
        # child k of a seeded request draws with seed + k: seeds n apart keep all 600 draws independent
        params = [SamplingParams(n=n, temperature=temperature, seed=7 + n * i, max_tokens=1) for i in range(num_requests)]
        outs = llm.generate([PROMPT] * num_requests, params, use_tqdm=False)
    first_tokens = torch.tensor([c.token_ids[0] for out in outs for c in out.outputs])
    assert len(first_tokens) == num_requests * n
    counts = torch.bincount(first_tokens, minlength=next_token_logits.shape[0])
    check_fits(counts, next_token_logits, temperature, 1.0, wrong_temperature=0.6)
