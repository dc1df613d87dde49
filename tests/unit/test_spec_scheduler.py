"""Scheduler arithmetic with speculative decoding, against a fake worker that verifies drafts.

The fake worker writes a fingerprint of each scheduled token's whole prefix into its KV slot
(drafts included, as a real worker writes their K/V before knowing whether they are accepted),
then checks that every slot a request reads holds its own prefix: a rejected draft's KV read
later, or a prefix-cache block registered over a draft, fails the test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from minivllm.core.scheduler import Scheduler
from minivllm.protocol.config import SpeculativeConfig
from minivllm.protocol.messages import ModelRunnerOutput, SchedulerOutput, unpack_token_ids
from tests.unit.scheduler_harness import (
    EOS,
    WorkerRequestState,
    assert_no_leak,
    cdiv,
    check_invariants,
    default_token,
    make_config,
    make_request,
    schedulers_in_test,
)


def make_spec_scheduler(k: int = 3, num_gpu_blocks: int = 256, disable_by_batch_size: int | None = None,
                        **overrides) -> Scheduler:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3,
                             disable_by_batch_size=disable_by_batch_size)
    scheduler = Scheduler(make_config(speculative_config=spec, **overrides), num_gpu_blocks=num_gpu_blocks)
    schedulers_in_test.append(scheduler)
    return scheduler


@dataclass
class SpecFakeWorker:
    """Verifies drafts against the deterministic model `default_token` (greedy: a draft is accepted
    while it equals the model's token), and proposes drafts of which a random number are right."""

    scheduler: Scheduler
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    eos_at: dict[str, int] = field(default_factory=dict)  # request -> position where the model says EOS
    states: dict[str, WorkerRequestState] = field(default_factory=dict)
    kv_slots: dict[int, int] = field(default_factory=dict)
    steps_with_drafts: int = 0

    def model(self, req_id: str, position: int) -> int:
        return EOS if self.eos_at.get(req_id) == position else default_token(req_id, position)

    def propose(self, req_id: str, num_tokens: int) -> list[int]:
        k = self.scheduler.num_spec_tokens
        num_right = self.rng.randint(0, k)
        drafts = [self.model(req_id, num_tokens + i) for i in range(num_right)]
        return drafts + [7] * self.rng.randint(0, k - num_right)  # 7: never the model's token

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        block_size = self.scheduler.block_size
        for req_id in out.finished_req_ids + out.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.states[new.req_id] = WorkerRequestState(unpack_token_ids(new.prompt_token_ids) + new.output_token_ids,
                                                         list(new.block_ids), new.num_computed_tokens)
        for cached in out.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            if cached.num_released_blocks:
                del state.block_ids[-cached.num_released_blocks:]
            state.block_ids += cached.new_block_ids
        if out.scheduled_spec_decode_tokens:
            self.steps_with_drafts += 1

        def slot(state: WorkerRequestState, position: int) -> int:
            return state.block_ids[position // block_size] * block_size + position % block_size

        inputs = {}  # req_id -> the tokens this step runs (known ones, then drafts)
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            end = state.num_computed_tokens + num_tokens
            assert end == len(state.token_ids) + len(drafts) if drafts else end <= len(state.token_ids)
            assert len(drafts) <= self.scheduler.num_spec_tokens
            assert len(state.block_ids) == cdiv(end, block_size)
            assert state.block_ids == self.scheduler.kv_cache_manager.get_block_ids(req_id)
            tokens = state.token_ids + drafts
            inputs[req_id] = tokens
            parent = state.fingerprint(state.num_computed_tokens - 1) if state.num_computed_tokens else 0
            for position in range(state.num_computed_tokens, end):
                parent = state.fingerprint(position) if position < len(state.token_ids) else hash((parent, tokens[position]))
                self.kv_slots[slot(state, position)] = parent
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            for position in range(min(state.num_computed_tokens + num_tokens, len(state.token_ids))):
                assert self.kv_slots.get(slot(state, position)) == state.fingerprint(position), (
                    f"{req_id}: the KV of position {position} is not its own")

        req_ids, sampled, accepted_lists, next_drafts = [], [], [], []
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            end = state.num_computed_tokens + num_tokens
            if end - len(drafts) != len(state.token_ids):
                state.num_computed_tokens = end
                continue  # a prompt chunk that does not reach the end
            accepted = []
            for draft in drafts:
                if draft != self.model(req_id, len(state.token_ids)):
                    break
                accepted.append(draft)
                state.token_ids.append(draft)
            token = self.model(req_id, len(state.token_ids))
            state.token_ids.append(token)
            state.num_computed_tokens = len(state.token_ids) - 1
            req_ids.append(req_id)
            sampled.append(token)
            accepted_lists.append(accepted)
            next_drafts.append(self.propose(req_id, len(state.token_ids)) if out.propose_drafts else [])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 accepted_draft_token_ids=accepted_lists, spec_token_ids=next_drafts)


def run(scheduler: Scheduler, worker: SpecFakeWorker, pipelined: bool) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    empty = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
    for _ in range(5000):
        if not scheduler.has_unfinished_requests() and not in_flight:
            break
        out = scheduler.schedule()
        check_invariants_spec(scheduler, out)
        if out.total_num_scheduled_tokens:
            in_flight.append((out, worker.execute(out)))
        else:
            assert scheduler.update_from_output(out, empty) == []
            assert in_flight, "no progress"
        if len(in_flight) == (2 if pipelined and out.total_num_scheduled_tokens else 1) or (
                in_flight and not out.total_num_scheduled_tokens):
            done_out, result = in_flight.pop(0)
            for o in scheduler.update_from_output(done_out, result):
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    else:
        raise AssertionError("did not finish")
    assert_no_leak(scheduler)
    return tokens


def check_invariants_spec(scheduler: Scheduler, out: SchedulerOutput) -> None:
    check_invariants(scheduler, out)
    for req_id, drafts in out.scheduled_spec_decode_tokens.items():
        assert drafts and out.num_scheduled_tokens[req_id] == 1 + len(drafts)
    # Prefix-cache hashes only ever cover known (verified) tokens.
    for request in scheduler.running:
        num_cached = scheduler.kv_cache_manager.num_cached_blocks.get(request.request_id, 0)
        assert num_cached * scheduler.block_size <= request.num_tokens


def expected_tokens(req_id: str, num_prompt: int, max_tokens: int, eos_at: int | None = None) -> list[int]:
    out = []
    for position in range(num_prompt, num_prompt + max_tokens):
        if position == eos_at:
            return out + [EOS]
        out.append(default_token(req_id, position))
    return out


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_drafts_give_the_same_tokens_as_no_speculation(pipelined: bool, enable_prefix_caching: bool) -> None:
    rng = random.Random(1)
    scheduler = make_spec_scheduler(k=3, enable_prefix_caching=enable_prefix_caching, max_num_batched_tokens=40)
    worker = SpecFakeWorker(scheduler)
    expected = {}
    shared = list(range(100, 120))  # a shared prefix: cached blocks are reused by later requests
    for i in range(8):
        req_id = f"r{i}"
        prompt = shared + [500 + 37 * i + j for j in range(rng.randint(1, 30))]
        max_tokens = rng.randint(1, 25)
        eos_at = len(prompt) + rng.randint(0, max_tokens) if i % 3 == 0 else None
        if eos_at is not None:
            worker.eos_at[req_id] = eos_at
        scheduler.add_request(make_request(req_id, prompt_token_ids=prompt, max_tokens=max_tokens))
        expected[req_id] = expected_tokens(req_id, len(prompt), max_tokens, eos_at)
    assert run(scheduler, worker, pipelined) == expected
    assert worker.steps_with_drafts > 0
    stats = scheduler.make_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_drafts <= stats.spec_decode_num_draft_tokens
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # accepting position j needs all before it


def test_budget_max_tokens_and_max_model_len_trim_the_drafts() -> None:
    scheduler = make_spec_scheduler(k=4, max_num_batched_tokens=3, max_model_len=14)
    scheduler.add_request(make_request("a", prompt_token_ids=[11, 12], max_tokens=6))
    request = scheduler.requests["a"]
    out = scheduler.schedule()  # the prompt
    scheduler.update_from_output(out, ModelRunnerOutput(["a"], [20], spec_token_ids=[[21, 22, 23, 24]]))
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [21, 22]}  # the budget of 3: one token + 2 drafts
    assert out.num_scheduled_tokens == {"a": 3} and request.num_computed_tokens == 5
    # Two accepted: three new tokens; drafts for next time: max_tokens (6) leaves room for 1 + 1.
    scheduler.update_from_output(out, ModelRunnerOutput(["a"], [23], accepted_draft_token_ids=[[21, 22]],
                                                        spec_token_ids=[[24, 25, 26, 27]]))
    assert request.output_token_ids == [20, 21, 22, 23] and request.num_computed_tokens == 5
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [24]}
    scheduler.update_from_output(out, ModelRunnerOutput(["a"], [25], accepted_draft_token_ids=[[24]]))
    assert request.is_finished and request.output_token_ids == [20, 21, 22, 23, 24, 25]
    # max_model_len: 12 known tokens, max_model_len 14 -> one draft at most.
    scheduler.add_request(make_request("b", prompt_token_ids=list(range(30, 41)), max_tokens=None))
    out = scheduler.schedule()
    out = scheduler.schedule()  # the rest of the prompt (budget 3 per step)...
    while "b" not in {r for r in scheduler.requests if scheduler.requests[r].num_output_tokens}:
        result = ModelRunnerOutput(["b"], [50], spec_token_ids=[[51, 52, 53]]) if (
            scheduler.requests["b"].num_computed_tokens == 11) else ModelRunnerOutput([], [])
        scheduler.update_from_output(out, result)
        out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"b": [51]}
    scheduler.update_from_output(out, ModelRunnerOutput(["b"], [52], accepted_draft_token_ids=[[51]]))
    assert scheduler.requests == {}


def test_rejected_drafts_pull_back_num_computed_and_free_their_tail_blocks() -> None:
    scheduler = make_spec_scheduler(k=5, block_size=4)
    scheduler.add_request(make_request("a", prompt_token_ids=[11, 12, 13], max_tokens=20))
    request = scheduler.requests["a"]
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(["a"], [20], spec_token_ids=[[1, 2, 3, 4, 5]]))
    # 4 known tokens; the step runs token 3 and five drafts: positions 3..8, three blocks.
    out = scheduler.schedule()
    assert request.num_computed_tokens == 9
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 3
    free_before = scheduler.kv_cache_manager.get_num_free_blocks()
    # One accepted: positions 0..4 verified; the third block (positions 8..11) held only a rejected draft.
    scheduler.update_from_output(out, ModelRunnerOutput(["a"], [30], accepted_draft_token_ids=[[1]],
                                                        spec_token_ids=[[]]))
    assert request.num_computed_tokens == 5 and request.output_token_ids == [20, 1, 30]
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 2
    assert scheduler.kv_cache_manager.get_num_free_blocks() == free_before + 1
    out = scheduler.schedule()  # no drafts this time: a plain decode; the worker hears of the freed block
    assert out.scheduled_spec_decode_tokens == {}
    assert out.scheduled_cached_reqs[0].num_released_blocks == 1
    stats = scheduler.make_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens) == (1, 5, 1)
    assert stats.spec_decode_num_accepted_tokens_per_pos == [1, 0, 0, 0, 0]
    scheduler.abort_requests(["a"])


def test_speculation_steps_aside_above_disable_by_batch_size() -> None:
    scheduler = make_spec_scheduler(k=2, disable_by_batch_size=2)
    worker = SpecFakeWorker(scheduler)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", num_prompt_tokens=5, max_tokens=6, ignore_eos=True))
    out = scheduler.schedule()
    assert out.propose_drafts  # nothing runs yet: admission steps may propose
    scheduler.update_from_output(out, worker.execute(out))
    for _ in range(3):  # three running: no drafts, none proposed
        out = scheduler.schedule()
        assert not out.propose_drafts and not out.scheduled_spec_decode_tokens
        scheduler.update_from_output(out, worker.execute(out))
    scheduler.abort_requests(["r0"])
    out = scheduler.schedule()
    assert out.propose_drafts
    scheduler.abort_requests(["r1", "r2"])


def test_preemption_with_drafts_in_a_tiny_cache() -> None:
    scheduler = make_spec_scheduler(k=4, num_gpu_blocks=12, block_size=4, max_num_batched_tokens=32)
    worker = SpecFakeWorker(scheduler, rng=random.Random(3))
    expected = {}
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", prompt_token_ids=[300 + 10 * i + j for j in range(6)],
                                           max_tokens=12, ignore_eos=True))
        expected[f"r{i}"] = expected_tokens(f"r{i}", 6, 12)
    assert run(scheduler, worker, pipelined=True) == expected
    assert scheduler.num_preemptions > 0 and worker.steps_with_drafts > 0


def test_requests_asking_logprobs_never_get_drafts() -> None:
    from minivllm.protocol.sampling_params import SamplingParams

    scheduler = make_spec_scheduler(k=2)
    request = make_request("a", prompt_token_ids=[1, 3, 5], max_tokens=5)
    request.sampling_params = SamplingParams(max_tokens=5, logprobs=1)
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(["a"], [20], spec_token_ids=[[21, 22]]))
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {} and out.num_scheduled_tokens == {"a": 1}
    scheduler.abort_requests(["a"])
