"""A prefill step's last layer run for its sampled rows alone (worker/output_rows.py): the same
logits and the same KV cache as the whole layer, and the shortcut actually taken."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from minivllm.worker import output_rows
from minivllm.worker.model_runner import ModelRunner
from tests.tiny_models import ARCHS
from tests.unit.test_model_runner import ToyRequest, ToyScheduler, make_prompts, make_runner, run_to_completion


def run_recording(runner: ModelRunner, scheduler: ToyScheduler) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    """The requests' tokens, and every step's logits in order."""
    logits: list[torch.Tensor] = []
    compute_logits = runner.model.compute_logits

    def recording(hidden_states: torch.Tensor) -> torch.Tensor:
        out = compute_logits(hidden_states)
        logits.append(out.float().cpu())
        return out

    runner.model.compute_logits = recording
    for cache in runner.kv_caches:  # (blocks no step writes compare equal too)
        cache.zero_()
    return run_to_completion(runner, scheduler), logits


def compare_with_whole_last_layer(monkeypatch: pytest.MonkeyPatch, make: Callable[[], ModelRunner],
                                  requests: Callable[[], list[ToyRequest]], block_size: int, chunk_size: int,
                                  atol: float) -> int:
    """Runs the same requests with the shortcut and without; returns how many steps took it."""
    taken = []
    build = output_rows.output_rows

    def counting(step, kv_layout, device):
        taken.append(len(step.logits_indices))
        return build(step, kv_layout, device)

    monkeypatch.setattr(output_rows, "output_rows", counting)
    results = {}
    for enabled in (True, False):
        monkeypatch.setattr(output_rows, "ENABLED", enabled)
        runner = make()
        tokens, logits = run_recording(runner, ToyScheduler(requests(), block_size, chunk_size, seed=block_size))
        results[enabled] = tokens, logits, [cache.clone() for cache in runner.kv_caches]
    (tokens, logits, caches), (whole_tokens, whole_logits, whole_caches) = results[True], results[False]
    assert tokens == whole_tokens
    assert len(logits) == len(whole_logits)
    for mine, whole in zip(logits, whole_logits, strict=True):
        torch.testing.assert_close(mine, whole, atol=atol, rtol=atol)
    # Every layer's K/V, the last one's included, is written for every token either way.
    for mine, whole in zip(caches, whole_caches, strict=True):
        assert torch.equal(mine, whole)
    return len(taken)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_steps_sample_the_same_with_the_last_layer_on_sampled_rows(monkeypatch, tiny_model_factory,
                                                                         arch: str) -> None:
    """Late arrivals in chunks of 5 beside decodes (blocks of 7): prompt chunks that sample and
    that do not, in steps with decodes and alone."""
    model_dir = tiny_model_factory(arch)

    def requests() -> list[ToyRequest]:
        prompts = make_prompts(512)
        return [ToyRequest(f"r{i}", p, 12, arrival_step=3 * i) for i, p in enumerate(prompts)]

    taken = compare_with_whole_last_layer(monkeypatch, lambda: make_runner(model_dir, block_size=7), requests,
                                          block_size=7, chunk_size=5, atol=1e-5)
    assert taken >= 5


def test_a_long_prompt_alone_in_chunks(monkeypatch, tiny_model_factory) -> None:
    """A prompt that takes four steps: three sample nothing (their last layer stores K/V only)."""
    model_dir = tiny_model_factory("qwen3")
    prompt = make_prompts(512, seed=4)[3]  # 35 tokens

    def requests() -> list[ToyRequest]:
        return [ToyRequest("r0", list(prompt), 6)]

    taken = compare_with_whole_last_layer(monkeypatch, lambda: make_runner(model_dir, block_size=16), requests,
                                          block_size=16, chunk_size=10, atol=1e-5)
    assert taken == 4  # the prompt's steps; decode steps run the whole layer anyway


def test_wanted_only_where_some_rows_go_unread(monkeypatch) -> None:
    from minivllm.protocol.messages import NewRequestData, pack_token_ids
    from minivllm.protocol.sampling_params import SamplingParams
    from minivllm.worker.input_batch import InputBatch

    def step(prompt_lens: tuple[int, ...], scheduled: tuple[int, ...]):
        batch = InputBatch(4, 64, 4, torch.device("cpu"))
        for i, n in enumerate(prompt_lens):
            batch.add_request(NewRequestData(req_id=f"r{i}", prompt_token_ids=pack_token_ids(range(1, n + 1)),
                                             output_token_ids=[], sampling_params=SamplingParams(max_tokens=4),
                                             block_ids=list(range(4 * i, 4 * i + 3)), num_computed_tokens=0))
        return batch.prepare({f"r{i}": n for i, n in enumerate(scheduled)})

    assert output_rows.wanted(step((10, 3), (6, 3)))  # a chunk that samples nothing, a whole prompt
    assert output_rows.wanted(step((10,), (10,)))  # one prompt: one row of ten read
    assert not output_rows.wanted(step((1, 1), (1, 1)))  # every row samples
    drafts = step((10,), (10,))
    drafts.spec_logits_indices = drafts.logits_indices  # (verifying drafts: rows sample at several places)
    assert not output_rows.wanted(drafts)
    monkeypatch.setattr(output_rows, "ENABLED", False)
    assert not output_rows.wanted(step((10,), (10,)))
