"""Penalties, min_tokens, logit_bias and allowed_token_ids change exactly the logits they should."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.protocol.messages import NewRequestData
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.logits_processors import apply_logits_processors
from minivllm.worker.sampler import Sampler, SamplingMetadata

VOCAB = 10


def batch_with(*requests: tuple[list[int], list[int], SamplingParams]) -> tuple[InputBatch, np.ndarray]:
    """A persistent batch holding (prompt, output so far, params) requests; returns it and their rows."""
    batch = InputBatch(max_num_reqs=8, max_model_len=64, block_size=16, device=torch.device("cpu"))
    for i, (prompt, output, params) in enumerate(requests):
        batch.add_request(NewRequestData(req_id=str(i), prompt_token_ids=prompt, output_token_ids=output,
                                         sampling_params=params, block_ids=[i], num_computed_tokens=0,
                                         eos_token_ids=[0]))
    return batch, np.array([batch.row_of[str(i)] for i in range(len(requests))])


def test_untouched_rows_keep_their_logits_object() -> None:
    batch, rows = batch_with(([1, 2], [], SamplingParams()))
    logits = torch.randn(1, VOCAB)
    assert apply_logits_processors(logits, batch, rows) is logits


def test_penalties_follow_vllm_formulas() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    batch, rows = batch_with(([1, 2], [3, 3, 2], params), ([4], [], SamplingParams()))
    logits = torch.tensor([[1.0, -1.0, 1.0, 1.0, -2.0, 0, 0, 0, 0, 0], [1.0] * VOCAB])
    out = apply_logits_processors(logits.clone(), batch, rows)
    expected = logits[0].clone()
    expected[1] = -1.0 * 2.0  # prompt only: repetition (negative: multiplied)
    expected[2] = 1.0 / 2.0 - 0.25 * 1 - 0.5  # prompt + output once
    expected[3] = 1.0 / 2.0 - 0.25 * 2 - 0.5  # output twice
    assert torch.allclose(out[0], expected)
    assert torch.equal(out[1], logits[1])  # the other row is untouched


def test_min_tokens_holds_back_stop_tokens_until_reached() -> None:
    early = SamplingParams(min_tokens=3, stop_token_ids=[5])
    batch, rows = batch_with(([1], [7, 8], early), ([1], [7, 8, 9], early),
                             ([1], [], SamplingParams(min_tokens=2, ignore_eos=True)))
    out = apply_logits_processors(torch.zeros(3, VOCAB), batch, rows)
    assert out[0, 0] == out[0, 5] == float("-inf") and out[0, 1] == 0  # EOS (0) and the stop id
    assert torch.equal(out[1], torch.zeros(VOCAB))  # 3 outputs: free to stop
    assert torch.equal(out[2], torch.zeros(VOCAB))  # ignore_eos, no stop ids: nothing held back


def test_logit_bias_and_allowed_token_ids() -> None:
    batch, rows = batch_with(([1], [], SamplingParams(logit_bias={4: 2.5, 6: -1.0})),
                             ([1], [], SamplingParams(allowed_token_ids=[2, 3])))
    out = apply_logits_processors(torch.zeros(2, VOCAB), batch, rows)
    assert out[0, 4] == 2.5 and out[0, 6] == -1.0 and out[0, 5] == 0
    assert torch.isinf(out[1]).sum() == VOCAB - 2 and out[1, 2] == out[1, 3] == 0


@pytest.mark.parametrize("seed", range(5))
def test_min_p_near_one_is_greedy(seed: int) -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(seed)) * 3
    params = [SamplingParams(temperature=1.0, min_p=0.999)] * 4
    sampler = Sampler(torch.Generator().manual_seed(seed))
    tokens = sampler(logits, SamplingMetadata.from_params(params, [None] * 4, "cpu"))
    assert torch.equal(tokens, logits.argmax(-1))


def test_bad_words_ban_a_last_token_only_after_its_prefix() -> None:
    # Words (as the frontend tokenizes them): [5] always banned; [3, 4] bans 4 right after a 3;
    # [2, 3, 7] bans 7 right after 2, 3. Only the output counts (the prompt ends in 2, 3 here).
    params = SamplingParams()
    params._bad_words_token_ids = [[5], [3, 4], [2, 3, 7]]
    batch, rows = batch_with(([2, 3], [], params), ([1], [2, 3], params), ([1], [3, 3, 1], params),
                             ([1], [3], SamplingParams()))
    out = apply_logits_processors(torch.zeros(4, VOCAB), batch, rows)
    banned = [set(np.flatnonzero(torch.isinf(row).numpy()).tolist()) for row in out]
    assert banned == [{5}, {4, 5, 7}, {5}, set()]
