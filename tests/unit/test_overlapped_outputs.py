"""Overlapped outputs: the worker holds a step's sampled ids back until the next step's forward is
launched, which reads its input ids for them from the device (see worker/model_runner.py). Driven
in-process on CPU with the real Scheduler, pipelined as the EngineCore does with async
scheduling; tokens must equal those of plain synchronous steps, under preemption, prefix caching,
seeded sampling and penalties (which read the held-back tokens on the host)."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest
import torch

from minivllm.core.scheduler import Scheduler
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import EngineCoreRequest, ModelRunnerOutput, SchedulerOutput
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.worker.model_runner import OVERLAP_ENV, ModelRunner

EMPTY = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


def requests(vocab_size: int) -> list[EngineCoreRequest]:
    rng = random.Random(0)
    shared = [rng.randrange(1, vocab_size) for _ in range(12)]
    settings = [
        SamplingParams(temperature=0.0, max_tokens=14),
        SamplingParams(temperature=1.0, seed=11, max_tokens=12),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=16),
        SamplingParams(temperature=1.0, seed=3, presence_penalty=1.0, min_tokens=4, max_tokens=9),
    ]
    out = []
    for i in range(10):
        prompt = (shared if i % 2 else []) + [rng.randrange(1, vocab_size) for _ in range(rng.randint(1, 20))]
        out.append(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                     sampling_params=settings[i % len(settings)], arrival_time=0.0,
                                     eos_token_ids=[]))
    return out


def drive(runner: ModelRunner, scheduler: Scheduler, pipelined: bool) -> dict[str, list[int]]:
    """Like EngineCore.step_async (pipelined) or EngineCore.step: outputs come back in step order."""
    tokens: dict[str, list[int]] = {}
    in_flight: deque[SchedulerOutput] = deque()
    ready: deque[ModelRunnerOutput] = deque()
    for _ in range(2000):
        if not (scheduler.has_unfinished_requests() or in_flight):
            break
        submitted = False
        if scheduler.has_unfinished_requests() and len(in_flight) < (2 if pipelined else 1):
            scheduler_output = scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens:
                in_flight.append(scheduler_output)
                ready.extend(runner.run_step(scheduler_output))
                submitted = True
            else:
                scheduler.update_from_output(scheduler_output, EMPTY)
        if not submitted and len(ready) < len(in_flight):  # nothing new queued: flush what is held
            ready.extend(runner.finish_pending())
        while ready:
            for out in scheduler.update_from_output(in_flight.popleft(), ready.popleft()):
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not scheduler.has_unfinished_requests() and not in_flight and not runner.has_pending()
    return tokens


@pytest.mark.parametrize("num_gpu_blocks", [14, 200])  # 14 blocks of 4: heavy preemption
def test_overlapped_outputs_equal_synchronous_steps(tiny_llama, monkeypatch, num_gpu_blocks: int) -> None:
    results = []
    patched = []
    for overlap in (False, True):
        monkeypatch.setenv(OVERLAP_ENV, "1" if overlap else "0")
        config = EngineConfig.create(tiny_llama, device="cpu", dtype="float32", block_size=4,
                                     num_gpu_blocks=num_gpu_blocks, max_num_batched_tokens=24, max_num_seqs=6)
        runner = ModelRunner(config)
        runner.initialize_cache(num_gpu_blocks)
        assert runner.overlap_outputs is overlap
        original = runner._patch_pending_inputs

        def spy(input_ids, index, source, original=original):
            patched.append(overlap and len(index) > 0)
            original(input_ids, index, source)

        runner._patch_pending_inputs = spy
        scheduler = Scheduler(config, num_gpu_blocks)
        for request in requests(config.vocab_size):
            scheduler.add_request(request)
        results.append(drive(runner, scheduler, pipelined=overlap))
        if num_gpu_blocks == 14:
            assert scheduler.num_preemptions > 0
    assert results[1] == results[0]
    assert sum(patched) > 20, "the overlapped run should take most decode inputs from the device"


def test_draft_model_catch_up_reads_pending_inputs_from_the_device(tiny_llama, monkeypatch) -> None:
    """A draft model (here the target itself) runs every step's tokens after the target; with
    overlapped outputs some of those input ids are still on the device. Right after each step the
    draft's K/V at the step's verified positions must equal the target's (same weights, same
    tokens): a catch-up that read stale host ids there would not."""
    monkeypatch.setenv(OVERLAP_ENV, "1")
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 2, "disable_by_batch_size": 2}
    config = EngineConfig.create(tiny_llama, device="cpu", dtype="float32", block_size=4, num_gpu_blocks=200,
                                 max_num_batched_tokens=24, max_num_seqs=6, speculative_config=spec)
    runner = ModelRunner(config)
    runner.initialize_cache(200)
    draft = runner.spec_decoder.draft_runner
    steps: list = []
    prepare = runner.input_batch.prepare
    monkeypatch.setattr(runner.input_batch, "prepare", lambda *a, **k: steps.append(prepare(*a, **k)) or steps[-1])
    run_step = runner.run_step
    checked = {"pending": 0, "positions": 0}

    def checked_run_step(scheduler_output):
        outputs = run_step(scheduler_output)
        step = steps[-1]
        if scheduler_output.total_num_scheduled_tokens:
            batch = runner.input_batch
            rows = np.repeat([batch.row_of[r] for r in step.req_ids], np.diff(step.query_start_loc))
            verified = step.positions < batch.num_tokens[rows] - 1  # not a rejected draft's slot
            slots = torch.from_numpy(step.slot_mapping[verified])
            for target_layer, draft_layer in zip(runner.kv_caches, draft.kv_caches):
                target_kv = target_layer.flatten(1, 2)[:, slots]  # [2, slots, ...]: K and V
                draft_kv = draft_layer.flatten(1, 2)[:, slots]
                torch.testing.assert_close(draft_kv, target_kv, rtol=1e-4, atol=1e-4)
            checked["positions"] += int(verified.sum())
            if step.pending_token_index is not None:
                checked["pending"] += len(step.pending_token_index)
        return outputs

    runner.run_step = checked_run_step
    scheduler = Scheduler(config, 200)
    for request in requests(config.vocab_size)[:6]:
        scheduler.add_request(request)
    drive(runner, scheduler, pipelined=True)
    assert checked["pending"] > 10 and checked["positions"] > 100
    assert scheduler.spec_num_draft_tokens > 0
