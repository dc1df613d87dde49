"""The V1 token-budget Scheduler, driven by a fake worker (pure Python, no torch).

FakeWorker keeps per-request state the way the real worker does (full NewRequestData, then
deltas), checks every SchedulerOutput against that state, and samples a token for exactly
the requests whose scheduled range reaches the end of their known tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from core.request import RequestStatus
from core.scheduler import Scheduler
from protocol.config import EngineConfig
from protocol.messages import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineCoreOutput,
    EngineCoreRequest,
    ModelRunnerOutput,
    SchedulerOutput,
)
from protocol.sampling_params import SamplingParams

EOS = 2


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def make_config(**overrides) -> EngineConfig:
    fields = dict(
        model="fake-model",
        tokenizer="fake-model",
        max_model_len=1024,
        vocab_size=32000,
        eos_token_ids=[EOS],
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=16,
    )
    fields.update(overrides)
    return EngineConfig(**fields)


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int | None = 4,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
    arrival_time: float = 0.0,
) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        # 10.. so prompts never hold the EOS id.
        prompt_token_ids=[10 + i for i in range(num_prompt_tokens)],
        sampling_params=SamplingParams(
            max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids or []
        ),
        arrival_time=arrival_time,
        eos_token_ids=[EOS],
    )


def default_token(req_id: str, position: int) -> int:
    """A deterministic 'model': the token depends on the request and its position only."""
    return 1000 + sum(map(ord, req_id)) * 100 + position


@dataclass
class WorkerRequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class FakeWorker:
    scheduler: Scheduler
    next_token: Callable[[str, int], int] = default_token
    states: dict[str, WorkerRequestState] = field(default_factory=dict)
    # Every NewRequestData seen, in order, for assertions about resumption.
    new_reqs_seen: list = field(default_factory=list)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        block_size = self.scheduler.block_size
        for req_id in out.finished_req_ids + out.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent in full twice"
            self.new_reqs_seen.append(new)
            self.states[new.req_id] = WorkerRequestState(
                token_ids=new.prompt_token_ids + new.output_token_ids,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in out.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            state.block_ids += cached.new_block_ids

        scheduled = [r.req_id for r in out.scheduled_new_reqs] + [r.req_id for r in out.scheduled_cached_reqs]
        assert sorted(scheduled) == sorted(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())

        req_ids, tokens = [], []
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            assert num_tokens > 0
            end = state.num_computed_tokens + num_tokens
            assert end <= len(state.token_ids)
            # Exactly the blocks these tokens need, and the same ones the scheduler holds.
            assert len(state.block_ids) == cdiv(end, block_size)
            assert state.block_ids == self.scheduler.kv_cache_manager.get_block_ids(req_id)
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                token = self.next_token(req_id, len(state.token_ids))
                state.token_ids.append(token)
                req_ids.append(req_id)
                tokens.append(token)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=tokens)


@dataclass
class Run:
    """What a run to completion produced."""

    scheduler_outputs: list[SchedulerOutput]
    outputs: dict[str, list[EngineCoreOutput]]

    def tokens(self, req_id: str) -> list[int]:
        return [t for o in self.outputs[req_id] for t in o.new_token_ids]

    def finish_reason(self, req_id: str) -> str | None:
        return self.outputs[req_id][-1].finish_reason


def step(scheduler: Scheduler, worker: FakeWorker) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = scheduler.schedule()
    check_invariants(scheduler, out)
    if out.total_num_scheduled_tokens == 0:
        return out, scheduler.update_from_output(out, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
    return out, scheduler.update_from_output(out, worker.execute(out))


def check_invariants(scheduler: Scheduler, out: SchedulerOutput) -> None:
    config = scheduler.config
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(scheduler.running) <= config.max_num_seqs
    manager = scheduler.kv_cache_manager
    for request in scheduler.running:
        # After schedule(), num_computed_tokens includes this step's tokens; blocks cover exactly those.
        assert len(manager.get_block_ids(request.request_id)) == cdiv(request.num_computed_tokens, config.block_size)
    for request in scheduler.waiting:
        assert request.num_computed_tokens == 0
        assert manager.get_block_ids(request.request_id) == []
    held = sum(len(manager.get_block_ids(r.request_id)) for r in scheduler.running)
    assert held + manager.get_num_free_blocks() == manager.num_gpu_blocks


def run_to_completion(scheduler: Scheduler, worker: FakeWorker, max_steps: int = 10_000) -> Run:
    run = Run(scheduler_outputs=[], outputs={})
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out, outputs = step(scheduler, worker)
        assert out.total_num_scheduled_tokens > 0, "no progress"
        run.scheduler_outputs.append(out)
        for o in outputs:
            run.outputs.setdefault(o.request_id, []).append(o)
    else:
        raise AssertionError("did not finish")
    assert_no_leak(scheduler)
    return run


def assert_no_leak(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert scheduler.kv_cache_manager.req_to_blocks == {}


def make_scheduler(num_gpu_blocks: int = 256, **config_overrides) -> tuple[Scheduler, FakeWorker]:
    scheduler = Scheduler(make_config(**config_overrides), num_gpu_blocks=num_gpu_blocks)
    return scheduler, FakeWorker(scheduler)


# ---------------------------------------------------------------- basics


def test_single_request_prefill_then_decode() -> None:
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", 10, max_tokens=4))
    assert scheduler.has_unfinished_requests() and scheduler.get_num_unfinished_requests() == 1

    out, outputs = step(scheduler, worker)
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens, new.output_token_ids) == ("a", 0, [])
    assert new.block_ids == [0, 1, 2]  # 10 tokens, block size 4
    assert out.num_scheduled_tokens == {"a": 10} and out.scheduled_cached_reqs == []
    assert [o.new_token_ids for o in outputs] == [[default_token("a", 10)]]

    out, outputs = step(scheduler, worker)
    (cached,) = out.scheduled_cached_reqs
    assert (cached.req_id, cached.new_block_ids, cached.num_computed_tokens) == ("a", [], 10)
    assert out.num_scheduled_tokens == {"a": 1}

    out, outputs = step(scheduler, worker)
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 11
    assert out.scheduled_cached_reqs[0].new_block_ids == []  # token 11 still fits in block 2
    assert outputs[0].finish_reason is None

    out, outputs = step(scheduler, worker)
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 12
    assert out.scheduled_cached_reqs[0].new_block_ids == [3]  # token 12 starts block 3
    (final,) = outputs
    assert final.finish_reason == FINISH_LENGTH and final.stop_reason is None
    assert not scheduler.has_unfinished_requests()
    assert_no_leak(scheduler)


def test_empty_step_when_nothing_to_do() -> None:
    scheduler, _ = make_scheduler()
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 0
    assert out.scheduled_new_reqs == [] and out.scheduled_cached_reqs == [] and out.num_scheduled_tokens == {}
    assert scheduler.update_from_output(out, ModelRunnerOutput(req_ids=[], sampled_token_ids=[])) == []


def test_add_request_rejects_bad_requests() -> None:
    scheduler, _ = make_scheduler(max_model_len=32)
    scheduler.add_request(make_request("a", 4))
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("a", 4))  # id in use
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("b", 0))
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("c", 33))
    assert scheduler.get_num_unfinished_requests() == 1


# ---------------------------------------------------------------- budget and ordering


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("budget", [7, 32, 512])
def test_random_workload_respects_budget_and_completes(block_size: int, budget: int) -> None:
    rng = random.Random(block_size * 1000 + budget)
    scheduler, worker = make_scheduler(
        num_gpu_blocks=cdiv(2048, block_size), block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=6
    )
    max_tokens = {}
    for i in range(20):
        req_id = f"r{i}"
        max_tokens[req_id] = rng.randint(1, 12)
        scheduler.add_request(make_request(req_id, rng.randint(1, 60), max_tokens=max_tokens[req_id]))
    run = run_to_completion(scheduler, worker)
    for out in run.scheduler_outputs:
        assert out.total_num_scheduled_tokens <= budget
        assert len(out.num_scheduled_tokens) <= 6
    for req_id, n in max_tokens.items():
        assert len(run.tokens(req_id)) == n
        assert run.finish_reason(req_id) == FINISH_LENGTH


def test_decodes_are_scheduled_before_new_prefills() -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(make_request("a", 5, max_tokens=10))
    step(scheduler, worker)  # a prefilled, now decoding
    scheduler.add_request(make_request("b", 40, max_tokens=1))
    out, _ = step(scheduler, worker)
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["a"]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}  # b gets what a's decode left
    out, _ = step(scheduler, worker)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]


def test_long_prompt_is_chunked_and_only_the_last_chunk_samples() -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(make_request("a", 50, max_tokens=2))
    chunks = []
    for _ in range(3):
        out, outputs = step(scheduler, worker)
        chunks.append((out.num_scheduled_tokens["a"], _computed_before(out, "a")))
        assert outputs == []  # partial prefill: nothing sampled
    out, outputs = step(scheduler, worker)
    chunks.append((out.num_scheduled_tokens["a"], _computed_before(out, "a")))
    assert chunks == [(16, 0), (16, 16), (16, 32), (2, 48)]
    assert [o.new_token_ids for o in outputs] == [[default_token("a", 50)]]
    # The first chunk was sent in full, the rest as deltas with their new blocks.
    worker_block_ids = worker.states["a"].block_ids
    assert len(worker_block_ids) == cdiv(50, 4)
    assert worker_block_ids == scheduler.kv_cache_manager.get_block_ids("a")


def _computed_before(out: SchedulerOutput, req_id: str) -> int:
    for req in [*out.scheduled_new_reqs, *out.scheduled_cached_reqs]:
        if req.req_id == req_id:
            return req.num_computed_tokens
    raise KeyError(req_id)


def test_chunked_prompt_shares_the_budget_with_waiting_requests() -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", 14, max_tokens=1))
    scheduler.add_request(make_request("b", 3, max_tokens=1))
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 10}  # the budget is gone; b waits
    out, outputs = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 4, "b": 3}
    assert {o.request_id for o in outputs} == {"a", "b"}


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler, worker = make_scheduler(max_num_seqs=2)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 3, max_tokens=3))
    out, _ = step(scheduler, worker)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r0", "r1"]
    assert len(scheduler.waiting) == 3
    run = run_to_completion(scheduler, worker)
    assert all(len(out.num_scheduled_tokens) <= 2 for out in run.scheduler_outputs)
    assert sorted(run.outputs) == ["r0", "r1", "r2", "r3", "r4"]


def test_waiting_requests_are_admitted_first_come_first_served() -> None:
    # 6 blocks of 4: "big" cannot fit while "a" runs, and "small" must not jump ahead of it.
    scheduler, worker = make_scheduler(num_gpu_blocks=6, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 8, max_tokens=3))
    step(scheduler, worker)
    scheduler.add_request(make_request("big", 20, max_tokens=1))
    scheduler.add_request(make_request("small", 2, max_tokens=1))
    out, _ = step(scheduler, worker)
    assert list(out.num_scheduled_tokens) == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]
    run = run_to_completion(scheduler, worker)
    admitted = [n.req_id for out in run.scheduler_outputs for n in out.scheduled_new_reqs]
    assert admitted == ["big", "small"]


# ---------------------------------------------------------------- blocks


@pytest.mark.parametrize("block_size", [1, 2, 5, 16])
def test_blocks_allocated_exactly_as_needed_and_all_returned(block_size: int) -> None:
    scheduler, worker = make_scheduler(block_size=block_size, max_num_batched_tokens=13)
    prompts = {"a": 1, "b": block_size, "c": block_size + 1, "d": 3 * block_size + 2}
    for req_id, n in prompts.items():
        scheduler.add_request(make_request(req_id, n, max_tokens=block_size + 2))
    manager = scheduler.kv_cache_manager
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)  # check_invariants asserts ceil(computed / block_size) per request
        for request in scheduler.running:
            blocks = manager.req_to_blocks[request.request_id]
            assert all(block.ref_cnt == 1 for block in blocks)
    assert_no_leak(scheduler)


# ---------------------------------------------------------------- stop conditions


def scripted(tokens: dict[str, list[int]]) -> Callable[[str, int], int]:
    """A 'model' that emits the given tokens per request, then 7s."""
    counts: dict[str, int] = {}

    def next_token(req_id: str, position: int) -> int:
        i = counts.get(req_id, 0)
        counts[req_id] = i + 1
        script = tokens.get(req_id, [])
        return script[i] if i < len(script) else 7

    return next_token


def test_stop_on_eos() -> None:
    scheduler, worker = make_scheduler()
    worker.next_token = scripted({"a": [5, 6, EOS, 8]})
    scheduler.add_request(make_request("a", 4, max_tokens=10))
    run = run_to_completion(scheduler, worker)
    assert run.tokens("a") == [5, 6, EOS]
    final = run.outputs["a"][-1]
    assert (final.finish_reason, final.stop_reason) == (FINISH_STOP, None)


def test_ignore_eos_runs_to_max_tokens() -> None:
    scheduler, worker = make_scheduler()
    worker.next_token = scripted({"a": [EOS, EOS, EOS, EOS]})
    scheduler.add_request(make_request("a", 4, max_tokens=3, ignore_eos=True))
    run = run_to_completion(scheduler, worker)
    assert run.tokens("a") == [EOS, EOS, EOS]
    assert run.finish_reason("a") == FINISH_LENGTH


def test_stop_token_ids_set_stop_reason_and_win_over_eos() -> None:
    scheduler, worker = make_scheduler()
    worker.next_token = scripted({"a": [5, 42], "b": [EOS], "c": [EOS]})
    scheduler.add_request(make_request("a", 4, max_tokens=10, stop_token_ids=[42]))
    scheduler.add_request(make_request("b", 4, max_tokens=10, stop_token_ids=[EOS]))
    # A stop token ends the request even when EOS is ignored.
    scheduler.add_request(make_request("c", 4, max_tokens=10, stop_token_ids=[EOS], ignore_eos=True))
    run = run_to_completion(scheduler, worker)
    assert run.tokens("a") == [5, 42]
    for req_id, stop_token in [("a", 42), ("b", EOS), ("c", EOS)]:
        final = run.outputs[req_id][-1]
        assert (final.finish_reason, final.stop_reason) == (FINISH_STOP, stop_token)


def test_stop_at_max_tokens() -> None:
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", 4, max_tokens=1))
    scheduler.add_request(make_request("b", 4, max_tokens=5))
    run = run_to_completion(scheduler, worker)
    assert len(run.tokens("a")) == 1 and len(run.tokens("b")) == 5
    assert run.finish_reason("a") == run.finish_reason("b") == FINISH_LENGTH
    # Only the last output of a request carries a finish reason.
    assert all(o.finish_reason is None for o in run.outputs["b"][:-1])


def test_stop_at_max_model_len() -> None:
    scheduler, worker = make_scheduler(max_model_len=16, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 10, max_tokens=None))
    scheduler.add_request(make_request("b", 16, max_tokens=None))  # a full-length prompt still samples once
    run = run_to_completion(scheduler, worker)
    assert len(run.tokens("a")) == 6  # 10 + 6 = max_model_len
    assert len(run.tokens("b")) == 1
    assert run.finish_reason("a") == run.finish_reason("b") == FINISH_LENGTH


# ---------------------------------------------------------------- finished ids and aborts


def test_finished_ids_appear_in_the_next_scheduler_output_once() -> None:
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", 4, max_tokens=1))
    scheduler.add_request(make_request("b", 4, max_tokens=3))
    out, outputs = step(scheduler, worker)
    assert out.finished_req_ids == []
    assert [o.finish_reason for o in outputs if o.request_id == "a"] == [FINISH_LENGTH]
    out, _ = step(scheduler, worker)
    assert out.finished_req_ids == ["a"]
    out, _ = step(scheduler, worker)
    assert out.finished_req_ids == []
    assert not scheduler.has_unfinished_requests()


def test_finished_ids_are_kept_past_an_empty_step() -> None:
    # The engine does not send empty steps to the worker, so their finished ids must carry over.
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", 4, max_tokens=1))
    step(scheduler, worker)
    assert not scheduler.has_unfinished_requests()
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 0 and out.finished_req_ids == []
    scheduler.add_request(make_request("b", 4, max_tokens=1))
    out, _ = step(scheduler, worker)
    assert out.finished_req_ids == ["a"]


def test_abort_running_and_waiting_requests_frees_blocks_at_once() -> None:
    scheduler, worker = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", 9, max_tokens=10))
    scheduler.add_request(make_request("b", 4, max_tokens=10))
    step(scheduler, worker)
    manager = scheduler.kv_cache_manager
    assert manager.get_num_free_blocks() == manager.num_gpu_blocks - 3

    outputs = scheduler.abort_requests(["a", "b"])
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("a", [], FINISH_ABORT),
        ("b", [], FINISH_ABORT),
    ]
    assert_no_leak(scheduler)
    assert scheduler.running == [] and len(scheduler.waiting) == 0
    assert not scheduler.has_unfinished_requests()

    scheduler.add_request(make_request("c", 4, max_tokens=1))
    out, _ = step(scheduler, worker)
    assert sorted(out.finished_req_ids) == ["a", "b"]


def test_abort_unknown_finished_or_repeated_ids_is_harmless() -> None:
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", 4, max_tokens=1))
    scheduler.add_request(make_request("b", 4, max_tokens=5))
    step(scheduler, worker)  # a finishes
    assert scheduler.abort_requests(["nope", "a"]) == []
    outputs = scheduler.abort_requests(["b", "b"])
    assert [o.request_id for o in outputs] == ["b"]
    assert scheduler.abort_requests(["b"]) == []
    assert_no_leak(scheduler)
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 0


def test_abort_between_schedule_and_update_drops_the_token() -> None:
    scheduler, worker = make_scheduler()
    scheduler.add_request(make_request("a", 4, max_tokens=5))
    scheduler.add_request(make_request("b", 4, max_tokens=5))
    out = scheduler.schedule()
    runner_output = worker.execute(out)
    assert sorted(runner_output.req_ids) == ["a", "b"]
    assert [o.request_id for o in scheduler.abort_requests(["a"])] == ["a"]
    outputs = scheduler.update_from_output(out, runner_output)
    assert [o.request_id for o in outputs] == ["b"]
    run = run_to_completion(scheduler, worker)
    assert len(run.tokens("b")) == 4


# ---------------------------------------------------------------- preemption


def test_preemption_frees_the_latest_request_and_it_resumes_with_its_outputs() -> None:
    # 4 blocks of 2 slots: a and b each fill 2 with their prompts; a's first decode needs a third.
    scheduler, worker = make_scheduler(num_gpu_blocks=4, block_size=2)
    scheduler.add_request(make_request("a", 4, max_tokens=3))
    scheduler.add_request(make_request("b", 4, max_tokens=3))
    out, outputs = step(scheduler, worker)
    assert len(outputs) == 2
    b_first_token = default_token("b", 4)

    out, _ = step(scheduler, worker)
    assert out.preempted_req_ids == ["b"]
    assert list(out.num_scheduled_tokens) == ["a"]
    b = scheduler.waiting[0]
    assert (b.request_id, b.status, b.num_computed_tokens, b.num_preemptions) == ("b", RequestStatus.PREEMPTED, 0, 1)
    assert b.output_token_ids == [b_first_token]
    assert scheduler.kv_cache_manager.get_block_ids("b") == []

    run = run_to_completion(scheduler, worker)
    resumed = [n for n in worker.new_reqs_seen if n.req_id == "b"][-1]
    assert resumed.output_token_ids == [b_first_token]
    assert resumed.num_computed_tokens == 0
    assert resumed.prompt_token_ids == [10, 11, 12, 13]
    resumed_out = next(o for o in run.scheduler_outputs if any(n.req_id == "b" for n in o.scheduled_new_reqs))
    assert resumed_out.num_scheduled_tokens["b"] == 5  # prompt + the output token, recomputed
    assert len(run.tokens("b")) == 2  # plus the one before preemption = 3
    assert run.tokens("a") == [default_token("a", 6)]  # its third token; two came before


def test_a_request_that_cannot_grow_preempts_itself() -> None:
    # 5 blocks of 2: after both prompts, one block is free; a takes it, b must give way.
    scheduler, worker = make_scheduler(num_gpu_blocks=5, block_size=2)
    scheduler.add_request(make_request("a", 4, max_tokens=4))
    scheduler.add_request(make_request("b", 4, max_tokens=4))
    step(scheduler, worker)
    out, _ = step(scheduler, worker)
    assert out.preempted_req_ids == ["b"]
    assert list(out.num_scheduled_tokens) == ["a"]
    assert out.scheduled_cached_reqs[0].new_block_ids == [4]
    run_to_completion(scheduler, worker)


def test_abort_a_preempted_request() -> None:
    scheduler, worker = make_scheduler(num_gpu_blocks=4, block_size=2)
    scheduler.add_request(make_request("a", 4, max_tokens=3))
    scheduler.add_request(make_request("b", 4, max_tokens=3))
    step(scheduler, worker)
    out, _ = step(scheduler, worker)
    assert out.preempted_req_ids == ["b"]
    assert [o.finish_reason for o in scheduler.abort_requests(["b"])] == [FINISH_ABORT]
    run = run_to_completion(scheduler, worker)
    assert list(run.outputs) == ["a"]
    assert run.scheduler_outputs[0].finished_req_ids == ["b"]


def test_no_admission_in_a_step_with_preemption() -> None:
    scheduler, worker = make_scheduler(num_gpu_blocks=4, block_size=2)
    scheduler.add_request(make_request("a", 3, max_tokens=4))
    scheduler.add_request(make_request("b", 4, max_tokens=4))
    step(scheduler, worker)  # a: 2 blocks (3 tokens), b: 2 blocks
    scheduler.add_request(make_request("c", 1, max_tokens=1))
    out, _ = step(scheduler, worker)  # a's token 3 fits in its block; b's token 4 needs a block
    assert out.preempted_req_ids == ["b"]
    assert out.scheduled_new_reqs == []
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_tiny_block_pool_completes_every_request_with_preemptions(block_size: int) -> None:
    max_model_len = 24
    scheduler, worker = make_scheduler(
        num_gpu_blocks=cdiv(max_model_len, block_size),
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=16,
    )
    rng = random.Random(block_size)
    prompt_lens = [rng.randint(1, 12) for _ in range(8)]
    for i, prompt_len in enumerate(prompt_lens):
        scheduler.add_request(make_request(f"r{i}", prompt_len, max_tokens=8))
    run = run_to_completion(scheduler, worker)
    preempted = [req_id for out in run.scheduler_outputs for req_id in out.preempted_req_ids]
    assert preempted, "the pool should be too small to avoid preemption"
    for i in range(8):
        req_id = f"r{i}"
        # Preemption keeps generated tokens: exactly max_tokens in total, each seen once.
        assert run.tokens(req_id) == [default_token(req_id, prompt_lens[i] + k) for k in range(8)]
        assert run.finish_reason(req_id) == FINISH_LENGTH
    # Every resumption restarts from token 0 with the outputs generated so far (none if the
    # request was preempted mid-prefill).
    for req_id in set(preempted):
        sent = [n for n in worker.new_reqs_seen if n.req_id == req_id]
        assert len(sent) == 1 + preempted.count(req_id)
        for n in sent:
            assert n.num_computed_tokens == 0
            assert n.output_token_ids == run.tokens(req_id)[: len(n.output_token_ids)]
    assert any(n.output_token_ids for n in worker.new_reqs_seen), "some request resumed mid-decode"
