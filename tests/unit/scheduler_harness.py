"""Drive the Scheduler without torch: a fake worker, request/config builders, invariant checks.

FakeWorker keeps per-request state the way the real worker does (full NewRequestData, then
deltas), checks every SchedulerOutput against that state, and samples a token for exactly the
requests whose scheduled range reaches the end of their known tokens. It also simulates the KV
cache: each step it first writes, for every scheduled token, a fingerprint of the token's whole
prefix into the token's slot (as a real worker's layer writes K/V for the whole batch), then
checks that every slot each request attends to holds its own prefix — so a prefix-cache hit on
the wrong block, or on a block nobody computed, fails the test.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from minivllm.core.scheduler import Scheduler
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    ModelRunnerOutput,
    SchedulerOutput,
    unpack_token_ids,
)
from minivllm.protocol.sampling_params import SamplingParams

EOS = 2

# Every scheduler made through make_scheduler during the current test; the autouse fixture in
# conftest.py checks that those with no unfinished requests hold no blocks at the end.
schedulers_in_test: list[Scheduler] = []

_prompt_bases = itertools.count()


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
    num_prompt_tokens: int | None = None,
    max_tokens: int | None = 4,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
    arrival_time: float = 0.0,
    prompt_token_ids: list[int] | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
) -> EngineCoreRequest:
    """A request whose prompt is `prompt_token_ids`, or else `num_prompt_tokens` tokens no other
    request starts with (so nothing is shared by accident)."""
    if prompt_token_ids is None:
        assert num_prompt_tokens is not None
        base = 10 + 1000 * next(_prompt_bases)  # >= 10: prompts never hold the EOS id
        prompt_token_ids = [base + i for i in range(num_prompt_tokens)]
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=SamplingParams(
            max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids or []
        ),
        arrival_time=arrival_time,
        eos_token_ids=[EOS],
        priority=priority,
        cache_salt=cache_salt,
    )


def default_token(req_id: str, position: int) -> int:
    """A deterministic 'model': the token depends on the request and its position only."""
    return 1000 + sum(map(ord, req_id)) * 100 + position


@dataclass
class WorkerRequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    # prefix_fingerprints[p] stands for "the K/V of token p given tokens 0..p".
    prefix_fingerprints: list[int] = field(default_factory=list)

    def fingerprint(self, position: int) -> int:
        while len(self.prefix_fingerprints) <= position:
            i = len(self.prefix_fingerprints)
            parent = self.prefix_fingerprints[-1] if i else 0
            self.prefix_fingerprints.append(hash((parent, self.token_ids[i])))
        return self.prefix_fingerprints[position]


@dataclass
class FakeWorker:
    scheduler: Scheduler
    next_token: Callable[[str, int], int] = default_token
    states: dict[str, WorkerRequestState] = field(default_factory=dict)
    # Every NewRequestData seen, in order, for assertions about resumption.
    new_reqs_seen: list = field(default_factory=list)
    # The simulated KV cache: slot -> fingerprint of the prefix whose K/V it holds.
    kv_slots: dict[int, int] = field(default_factory=dict)
    num_computed_tokens_total: int = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        block_size = self.scheduler.block_size
        for req_id in out.finished_req_ids + out.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent in full twice"
            self.new_reqs_seen.append(new)
            self.states[new.req_id] = WorkerRequestState(
                token_ids=unpack_token_ids(new.prompt_token_ids) + new.output_token_ids,
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

        def slot(state: WorkerRequestState, position: int) -> int:
            return state.block_ids[position // block_size] * block_size + position % block_size

        # Write K/V of every scheduled token first, as each layer of a real worker does...
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            assert num_tokens > 0
            end = state.num_computed_tokens + num_tokens
            assert end <= len(state.token_ids)
            # Exactly the blocks these tokens need, and the same ones the scheduler holds.
            assert len(state.block_ids) == cdiv(end, block_size)
            assert state.block_ids == self.scheduler.kv_cache_manager.get_block_ids(req_id)
            for position in range(state.num_computed_tokens, end):
                self.kv_slots[slot(state, position)] = state.fingerprint(position)
            self.num_computed_tokens_total += num_tokens
        # ...then "attend": each request reads its whole prefix from its blocks.
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            end = state.num_computed_tokens + num_tokens
            for position in range(end):
                assert self.kv_slots.get(slot(state, position)) == state.fingerprint(position), (
                    f"{req_id}: the KV of position {position} is not its own"
                )

        req_ids, tokens = [], []
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            state.num_computed_tokens += num_tokens
            if state.num_computed_tokens == len(state.token_ids):
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
    pool = manager.block_pool
    holders: dict[int, int] = {}
    for request in scheduler.running:
        # After schedule(), num_computed_tokens includes this step's tokens; blocks cover exactly those.
        block_ids = manager.get_block_ids(request.request_id)
        assert len(block_ids) == cdiv(request.num_computed_tokens, config.block_size)
        assert len(set(block_ids)) == len(block_ids)
        for block_id in block_ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    for request in scheduler.waiting:
        assert request.num_computed_tokens == 0
        assert manager.get_block_ids(request.request_id) == []
    # A block's ref count is the number of requests holding it; the rest are all free.
    for block in pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
    assert len(holders) + manager.get_num_free_blocks() == manager.num_gpu_blocks
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash


def run_to_completion(scheduler: Scheduler, worker: FakeWorker, max_steps: int = 10_000,
                      pipelined: bool = False, steps_in_flight: int = 2,
                      before_schedule: Callable[[], None] | None = None) -> Run:
    """Step until every request finished. pipelined: as the EngineCore with async scheduling,
    steps N+1 .. N+steps_in_flight-1 are scheduled (and run by the worker, which has step N's
    tokens) before the scheduler sees step N's tokens. before_schedule (pipelined only): called
    before each schedule(), as the engine's busy loop takes what arrived."""
    if pipelined:
        return _run_pipelined(scheduler, worker, max_steps, steps_in_flight, before_schedule)
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


def _run_pipelined(scheduler: Scheduler, worker: FakeWorker, max_steps: int, steps_in_flight: int,
                   before_schedule: Callable[[], None] | None) -> Run:
    run = Run(scheduler_outputs=[], outputs={})
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    empty = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and not in_flight:
            break
        submitted = False
        if before_schedule is not None:
            before_schedule()
        if scheduler.has_unfinished_requests() and len(in_flight) < steps_in_flight:
            out = scheduler.schedule()
            check_invariants(scheduler, out)
            if out.total_num_scheduled_tokens > 0:
                in_flight.append((out, worker.execute(out)))
                run.scheduler_outputs.append(out)
                submitted = True
            else:
                assert scheduler.update_from_output(out, empty) == []
                assert in_flight, "no progress"
        if not in_flight or (submitted and len(in_flight) < steps_in_flight):
            continue
        out, result = in_flight.pop(0)
        for o in scheduler.update_from_output(out, result):
            run.outputs.setdefault(o.request_id, []).append(o)
    else:
        raise AssertionError("did not finish")
    assert_no_leak(scheduler)
    return run


def assert_no_leak(scheduler: Scheduler) -> None:
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert manager.req_to_blocks == {} and manager.num_cached_blocks == {}
    assert scheduler.running == [] and len(scheduler.waiting) == 0


def make_scheduler(num_gpu_blocks: int = 256, **config_overrides) -> tuple[Scheduler, FakeWorker]:
    scheduler = Scheduler(make_config(**config_overrides), num_gpu_blocks=num_gpu_blocks)
    schedulers_in_test.append(scheduler)
    return scheduler, FakeWorker(scheduler)
