"""Async scheduling: step N+1 is scheduled before step N's tokens reach the scheduler (pure
Python, the fake worker of scheduler_harness.py). The scheduler counts each sampling request's
coming token as a placeholder; outputs must not change, and little work may be wasted."""

from __future__ import annotations

import random
import zlib

import pytest

from minivllm.protocol.messages import FINISH_LENGTH, FINISH_STOP, ModelRunnerOutput
from tests.unit.scheduler_harness import EOS, cdiv, make_request, make_scheduler, run_to_completion


def sometimes_eos(req_id: str, position: int) -> int:
    """A deterministic 'model' that ends some requests early with EOS."""
    value = zlib.crc32(f"{req_id}:{position}".encode()) % 1000
    return EOS if value < 80 else 100 + value


def add_workload(scheduler, seed: int, n: int = 24) -> None:
    rng = random.Random(seed)
    shared = [9000 + i for i in range(40)]
    for i in range(n):
        length = rng.randint(1, 40)
        prompt = shared[: rng.randint(0, length)]
        prompt += [30000 + 100 * i + j for j in range(length - len(prompt))]
        scheduler.add_request(make_request(f"r{i}", prompt_token_ids=prompt, max_tokens=rng.randint(1, 16)))


@pytest.mark.parametrize("steps_in_flight", [2, 3])
@pytest.mark.parametrize("enable_prefix_caching", [False, True])
@pytest.mark.parametrize("num_gpu_blocks", [12, 400])  # 12: preemptions
@pytest.mark.parametrize("budget", [5, 64])
def test_pipelined_outputs_equal_synchronous(enable_prefix_caching: bool, num_gpu_blocks: int, budget: int,
                                             steps_in_flight: int) -> None:
    """Three in flight: a request preempted while in two steps may run again before the later
    one reports, whose token for it must then be dropped (it was sampled before the preemption)."""
    runs = []
    for pipelined in (False, True):
        scheduler, worker = make_scheduler(
            num_gpu_blocks=num_gpu_blocks, block_size=4, max_num_batched_tokens=budget, max_num_seqs=8,
            max_model_len=48, enable_prefix_caching=enable_prefix_caching,
        )
        worker.next_token = sometimes_eos
        add_workload(scheduler, seed=budget + num_gpu_blocks)
        runs.append((run_to_completion(scheduler, worker, pipelined=pipelined, steps_in_flight=steps_in_flight),
                     scheduler))
    (sync_run, _), (async_run, async_scheduler) = runs
    assert sync_run.outputs.keys() == async_run.outputs.keys()
    for req_id in sync_run.outputs:
        assert async_run.tokens(req_id) == sync_run.tokens(req_id), req_id
        assert async_run.finish_reason(req_id) == sync_run.finish_reason(req_id), req_id
    assert all(r.num_output_placeholders == 0 for r in async_scheduler.requests.values())


def test_requests_ending_at_max_tokens_waste_no_step() -> None:
    """The scheduler knows a request reaching max_tokens with its token in flight is done."""
    counts = []
    for pipelined in (False, True):
        scheduler, worker = make_scheduler(block_size=4, max_num_batched_tokens=64)
        for i in range(6):
            scheduler.add_request(make_request(f"r{i}", 5 + 3 * i, max_tokens=1 + 2 * i))
        run = run_to_completion(scheduler, worker, pipelined=pipelined)
        assert all(run.finish_reason(f"r{i}") == FINISH_LENGTH for i in range(6))
        counts.append(worker.num_computed_tokens_total)
    assert counts[0] == counts[1]


@pytest.mark.parametrize("steps_in_flight", [2, 3])
def test_an_eos_costs_a_token_per_step_ahead(steps_in_flight: int) -> None:
    counts = []
    for pipelined in (False, True):
        scheduler, worker = make_scheduler(block_size=4)
        worker.next_token = lambda req_id, position: EOS if position == 12 else 7
        scheduler.add_request(make_request("a", 10, max_tokens=20))
        run = run_to_completion(scheduler, worker, pipelined=pipelined, steps_in_flight=steps_in_flight)
        assert run.tokens("a") == [7, 7, EOS] and run.finish_reason("a") == FINISH_STOP
        counts.append(worker.num_computed_tokens_total)
    # the decodes scheduled before the EOS was seen
    assert counts[1] == counts[0] + steps_in_flight - 1


def test_a_reused_request_id_does_not_take_the_old_requests_token() -> None:
    scheduler, worker = make_scheduler(block_size=4)
    worker.next_token = lambda req_id, position: EOS
    scheduler.add_request(make_request("a", 4, max_tokens=10))
    step0 = scheduler.schedule()
    result0 = worker.execute(step0)
    step1 = scheduler.schedule()  # "a" decodes its (unknown here) first token
    assert step1.num_scheduled_tokens == {"a": 1}
    result1 = worker.execute(step1)
    [out] = scheduler.update_from_output(step0, result0)
    assert out.finish_reason == FINISH_STOP
    scheduler.add_request(make_request("a", 6, max_tokens=10))  # a new request, same id
    step2 = scheduler.schedule()
    assert [n.req_id for n in step2.scheduled_new_reqs] == ["a"] and step2.finished_req_ids == ["a"]
    result2 = worker.execute(step2)
    assert scheduler.update_from_output(step1, result1) == []  # the old "a"'s extra token
    new_a = scheduler.requests["a"]
    assert new_a.output_token_ids == [] and new_a.num_output_placeholders == 1
    [out] = scheduler.update_from_output(step2, result2)
    assert out.new_token_ids == [EOS] and new_a.num_output_placeholders == 0
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
    assert not scheduler.has_unfinished_requests()


def test_placeholders_let_a_decode_be_scheduled_before_its_token_arrives() -> None:
    scheduler, worker = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", 7, max_tokens=3))
    request = scheduler.requests["a"]
    steps = [scheduler.schedule()]
    results = [worker.execute(steps[0])]
    assert request.num_output_placeholders == 1 and request.num_computed_tokens == 7
    steps.append(scheduler.schedule())
    results.append(worker.execute(steps[1]))
    assert steps[1].num_scheduled_tokens == {"a": 1}
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 8
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == cdiv(8, 4)
    # Deeper than the EngineCore ever goes, but the arithmetic holds: a third decode is needed...
    steps.append(scheduler.schedule())
    results.append(worker.execute(steps[2]))
    assert steps[2].num_scheduled_tokens == {"a": 1}
    # ...and with three tokens in flight = max_tokens there is nothing more to run.
    idle = scheduler.schedule()
    assert idle.total_num_scheduled_tokens == 0
    scheduler.update_from_output(idle, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
    for out, result in zip(steps, results):
        scheduler.update_from_output(out, result)
    assert len(request.output_token_ids) == 3 and request.finish_reason == FINISH_LENGTH
    assert request.num_output_placeholders == 0 and not scheduler.has_unfinished_requests()


@pytest.mark.parametrize("setting", ["1", "0", "two", "-3"])
def test_steps_in_flight_setting_is_checked_before_any_worker_starts(monkeypatch, setting: str) -> None:
    from minivllm.core import engine_core
    from tests.unit.scheduler_harness import make_config

    monkeypatch.setenv("MINIVLLM_STEPS_IN_FLIGHT", setting)
    monkeypatch.setattr(engine_core, "make_executor", lambda config: pytest.fail("a worker was started"))
    with pytest.raises(ValueError, match="MINIVLLM_STEPS_IN_FLIGHT=.*must be an integer >= 2"):
        engine_core.EngineCore(make_config())
