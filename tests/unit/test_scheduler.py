"""The V1 token-budget Scheduler, driven by a fake worker (pure Python, no torch; see
scheduler_harness.py). Prefix caching is on (the default) but prompts share nothing unless a
test says so; tests/unit/test_prefix_caching.py covers sharing."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from minivllm.core.request import RequestStatus
from minivllm.protocol.messages import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    ModelRunnerOutput,
    SchedulerOutput,
    unpack_token_ids,
)
from tests.unit.scheduler_harness import (
    EOS,
    assert_no_leak,
    cdiv,
    default_token,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)

def random_prompts(rng: random.Random, n: int, min_len: int, max_len: int) -> list[list[int]]:
    """Prompts of random length, most starting with one of three shared prefixes."""
    prefixes = [[], [7000 + i for i in range(max_len)], [8000 + i for i in range(max_len)]]
    prompts = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        prefix = rng.choice(prefixes)[: rng.randint(0, length)]
        prompts.append(prefix + [20000 + 100 * i + j for j in range(length - len(prefix))])
    return prompts


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


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("enable_prefix_caching", [False, True])
@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("budget", [7, 32, 512])
def test_random_workload_respects_budget_and_completes(block_size: int, budget: int, enable_prefix_caching: bool,
                                                       pipelined: bool) -> None:
    rng = random.Random(block_size * 1000 + budget)
    scheduler, worker = make_scheduler(
        num_gpu_blocks=cdiv(2048, block_size), block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=6,
        enable_prefix_caching=enable_prefix_caching,
    )
    max_tokens = {}
    for i, prompt in enumerate(random_prompts(rng, 20, 1, 60)):
        req_id = f"r{i}"
        max_tokens[req_id] = rng.randint(1, 12)
        scheduler.add_request(make_request(req_id, prompt_token_ids=prompt, max_tokens=max_tokens[req_id]))
    run = run_to_completion(scheduler, worker, pipelined=pipelined)
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


@pytest.mark.parametrize("apply_after_each_step", [False, True])
def test_deferred_block_updates_change_no_step(apply_after_each_step: bool) -> None:
    """defer_block_updates, as the engine's busy loop runs the scheduler: a finished or aborted
    request's blocks stay taken, and the blocks a step fills stay out of the prefix cache, until
    apply_deferred_block_updates() (after the step and its outputs went out), the next schedule()
    or a prefix-cache lookup. So the same workload hands out the same blocks and the same prefix-cache
    hits, step by step, as with immediate updates, and the cache holds the same blocks once applied."""
    traces = []
    for defer in (False, True):
        rng = random.Random(5)
        scheduler, worker = make_scheduler(num_gpu_blocks=40, block_size=4, max_num_batched_tokens=24, max_num_seqs=4)
        scheduler.defer_block_updates = defer
        manager = scheduler.kv_cache_manager
        assert manager.defer_caching == defer
        for i, prompt in enumerate(random_prompts(rng, 14, 1, 30)):
            scheduler.add_request(make_request(f"r{i}", prompt_token_ids=prompt, max_tokens=rng.randint(1, 6)))
        trace = []
        num_steps_caching_waited = 0
        while scheduler.has_unfinished_requests():
            if len(trace) == 3 and scheduler.running:  # an abort between steps: deferred too
                scheduler.abort_requests([scheduler.running[-1].request_id])
            out, outputs = step(scheduler, worker)
            finished = [o.request_id for o in outputs if o.finish_reason is not None]
            waiting = scheduler._finished_blocks
            assert len(waiting) == (len(finished) if defer else 0)
            assert all(block.ref_cnt >= 1 for blocks in waiting for block in blocks)  # still taken
            if manager._blocks_to_cache:  # filled blocks the step did not register yet
                assert defer
                num_steps_caching_waited += 1
            free_before = manager.get_num_free_blocks()
            cache = manager.block_pool.cached_block_hash_to_block
            if apply_after_each_step:
                scheduler.apply_deferred_block_updates()
                assert not waiting and not manager._blocks_to_cache
                assert manager.get_num_free_blocks() >= free_before
                trace.append(sorted((h, block.block_id) for h, block in cache.items()))
            trace.append((out, outputs))
        scheduler.apply_deferred_block_updates()
        assert_no_leak(scheduler)
        traces.append(trace)
        assert (num_steps_caching_waited > 0) == defer
    assert traces[0] == traces[1]



def test_num_deferred_block_updates_counts_what_waits() -> None:
    """The count the engine's busy loop reads to decide whether the socket thread sends first: the
    blocks a step filled and did not register yet, then a finished request's blocks to give back."""
    scheduler, worker = make_scheduler(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=24)
    scheduler.defer_block_updates = True
    manager = scheduler.kv_cache_manager
    scheduler.add_request(make_request("a", 50, max_tokens=1))  # 13 blocks, in chunks of 24 tokens
    assert scheduler.num_deferred_block_updates() == 0
    registered = []
    while scheduler.has_unfinished_requests():
        out, outputs = step(scheduler, worker)
        cached_before = len(manager.block_pool.cached_block_hash_to_block)
        expected = scheduler.num_deferred_block_updates()
        finished = outputs and outputs[0].finish_reason is not None
        scheduler.apply_deferred_block_updates()
        assert scheduler.num_deferred_block_updates() == 0
        newly = len(manager.block_pool.cached_block_hash_to_block) - cached_before
        registered.append(newly)
        assert expected == newly + (13 if finished else 0)
    assert registered == [6, 6, 0]  # chunks of 24, 24 and 2 tokens: the last fills no block
    assert_no_leak(scheduler)

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
    # Without prefix caching b recomputes everything (test_prefix_caching.py covers the rest).
    scheduler, worker = make_scheduler(num_gpu_blocks=4, block_size=2, enable_prefix_caching=False)
    scheduler.add_request(make_request("a", 4, max_tokens=3))
    b_prompt = [10, 11, 12, 13]
    scheduler.add_request(make_request("b", prompt_token_ids=b_prompt, max_tokens=3))
    out, outputs = step(scheduler, worker)
    assert len(outputs) == 2
    b_first_token = default_token("b", 4)

    out, _ = step(scheduler, worker)
    assert out.preempted_req_ids == ["b"]
    assert list(out.num_scheduled_tokens) == ["a"]
    b = scheduler.waiting.peek()
    assert (b.request_id, b.status, b.num_computed_tokens, b.num_preemptions) == ("b", RequestStatus.PREEMPTED, 0, 1)
    assert b.output_token_ids == [b_first_token]
    assert scheduler.kv_cache_manager.get_block_ids("b") == []

    run = run_to_completion(scheduler, worker)
    resumed = [n for n in worker.new_reqs_seen if n.req_id == "b"][-1]
    assert resumed.output_token_ids == [b_first_token]
    assert resumed.num_computed_tokens == 0
    assert unpack_token_ids(resumed.prompt_token_ids) == b_prompt
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


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "priority", "v0"])
@pytest.mark.parametrize("enable_prefix_caching", [False, True])
@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_tiny_block_pool_completes_every_request_with_preemptions(
    block_size: int, enable_prefix_caching: bool, policy: str, pipelined: bool
) -> None:
    max_model_len = 24
    scheduler, worker = make_scheduler(
        num_gpu_blocks=cdiv(max_model_len, block_size),
        block_size=block_size,
        max_model_len=max_model_len,
        # v0 prefills whole prompts (+ outputs, after a preemption): the budget must hold them.
        max_num_batched_tokens=max_model_len if policy == "v0" else 16,
        scheduling_policy=policy,
        enable_prefix_caching=enable_prefix_caching,
    )
    rng = random.Random(block_size)
    prompts = random_prompts(rng, 8, 1, 12)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(
            make_request(f"r{i}", prompt_token_ids=prompt, max_tokens=8, priority=rng.randint(0, 2))
        )
    run = run_to_completion(scheduler, worker, pipelined=pipelined)
    preempted = [req_id for out in run.scheduler_outputs for req_id in out.preempted_req_ids]
    assert preempted, "the pool should be too small to avoid preemption"
    assert scheduler.num_preemptions == len(preempted)
    for i in range(8):
        req_id = f"r{i}"
        # Preemption keeps generated tokens: exactly max_tokens in total, each seen once.
        assert run.tokens(req_id) == [default_token(req_id, len(prompts[i]) + k) for k in range(8)]
        assert run.finish_reason(req_id) == FINISH_LENGTH
    # Every resumption restarts with the outputs generated so far (none if the request was
    # preempted mid-prefill), from token 0 — or, with prefix caching, past its blocks still cached
    # (FakeWorker checks those hold the request's own prefix).
    for req_id in set(preempted):
        sent = [n for n in worker.new_reqs_seen if n.req_id == req_id]
        assert len(sent) == 1 + preempted.count(req_id)
        for n in sent:
            num_known = n.num_prompt_tokens + len(n.output_token_ids)
            if enable_prefix_caching:
                assert n.num_computed_tokens % block_size == 0 and n.num_computed_tokens < num_known
            else:
                assert n.num_computed_tokens == 0
            assert n.output_token_ids == run.tokens(req_id)[: len(n.output_token_ids)]
    assert any(n.output_token_ids for n in worker.new_reqs_seen), "some request resumed mid-decode"


# ---------------------------------------------------------------- policies


def admitted_order(run) -> list[str]:
    return [n.req_id for out in run.scheduler_outputs for n in out.scheduled_new_reqs]


def test_priority_policy_admits_lowest_priority_value_first_ties_by_arrival() -> None:
    scheduler, worker = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    for req_id, priority, arrival in [("p3", 3, 0.0), ("p1-late", 1, 2.0), ("p2", 2, 1.0), ("p1", 1, 1.0),
                                      ("p1-same-time", 1, 1.0), ("p0", 0, 5.0)]:
        scheduler.add_request(make_request(req_id, 3, max_tokens=2, priority=priority, arrival_time=arrival))
    assert [r.request_id for r in scheduler.waiting] == ["p0", "p1", "p1-same-time", "p1-late", "p2", "p3"]
    run = run_to_completion(scheduler, worker)
    assert admitted_order(run) == ["p0", "p1", "p1-same-time", "p1-late", "p2", "p3"]


def test_fcfs_policy_ignores_priority() -> None:
    scheduler, worker = make_scheduler(max_num_seqs=1)
    for i, priority in enumerate([3, 0, 1]):
        scheduler.add_request(make_request(f"r{i}", 3, max_tokens=1, priority=priority, arrival_time=float(i)))
    assert admitted_order(run_to_completion(scheduler, worker)) == ["r0", "r1", "r2"]


@pytest.mark.parametrize("policy, victim", [("fcfs", "high"), ("priority", "low")])
def test_preemption_victim_is_the_latest_admitted_or_the_lowest_priority(policy: str, victim: str) -> None:
    # 6 blocks of 2. "low" (priority 5) runs first; "high" (priority 0) is admitted a step later.
    # When both grow past the pool, fcfs preempts the latest admitted, priority the lowest priority.
    scheduler, worker = make_scheduler(num_gpu_blocks=6, block_size=2, scheduling_policy=policy)
    scheduler.add_request(make_request("low", 4, max_tokens=8, priority=5, arrival_time=0.0))
    step(scheduler, worker)
    scheduler.add_request(make_request("high", 4, max_tokens=8, priority=0, arrival_time=1.0))
    run = run_to_completion(scheduler, worker)
    preempted = [r for out in run.scheduler_outputs for r in out.preempted_req_ids]
    assert preempted and set(preempted) == {victim}
    assert len(run.tokens("high")) == 8 and len(run.tokens("low")) == 7  # low's first came before


def test_priority_policy_serves_running_requests_in_priority_order() -> None:
    # With a budget too small for every decode, the important requests decode first.
    scheduler, worker = make_scheduler(max_num_batched_tokens=2, scheduling_policy="priority")
    for req_id, priority in [("c", 2), ("a", 0), ("b", 1)]:
        scheduler.add_request(make_request(req_id, 1, max_tokens=5, priority=priority))
    out, _ = step(scheduler, worker)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    out, _ = step(scheduler, worker)
    assert list(out.num_scheduled_tokens) == ["a", "b"]  # c still waits: no seat in the budget
    run_to_completion(scheduler, worker)


def test_abort_a_waiting_request_under_the_priority_policy() -> None:
    scheduler, worker = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    for req_id, priority in [("a", 0), ("b", 1), ("c", 2)]:
        scheduler.add_request(make_request(req_id, 3, max_tokens=2, priority=priority))
    step(scheduler, worker)
    assert [o.request_id for o in scheduler.abort_requests(["b"])] == ["b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    assert admitted_order(run_to_completion(scheduler, worker)) == ["c"]


def test_v0_steps_are_all_whole_prompt_prefills_or_all_decodes() -> None:
    rng = random.Random(5)
    scheduler, worker = make_scheduler(
        num_gpu_blocks=40, block_size=4, max_num_batched_tokens=96, max_model_len=96, scheduling_policy="v0"
    )
    prompts = random_prompts(rng, 12, 1, 40)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"r{i}", prompt_token_ids=prompt, max_tokens=rng.randint(1, 10)))
    run = run_to_completion(scheduler, worker)
    kinds = []
    for out in run.scheduler_outputs:
        if out.scheduled_new_reqs:
            assert out.scheduled_cached_reqs == [], "a v0 prefill step runs no decodes"
            for new in out.scheduled_new_reqs:  # whole prompt (and outputs, if resumed) at once
                num_known = new.num_prompt_tokens + len(new.output_token_ids)
                assert new.num_computed_tokens + out.num_scheduled_tokens[new.req_id] == num_known
            kinds.append("prefill")
        else:
            assert set(out.num_scheduled_tokens.values()) == {1}
            kinds.append("decode")
    assert "prefill" in kinds and "decode" in kinds


def test_v0_stalls_running_decodes_for_a_new_prompt_and_v1_does_not() -> None:
    for policy, expected in [("v0", {"b": 30}), ("fcfs", {"a": 1, "b": 30})]:
        scheduler, worker = make_scheduler(max_num_batched_tokens=64, scheduling_policy=policy)
        scheduler.add_request(make_request("a", 5, max_tokens=10))
        step(scheduler, worker)
        scheduler.add_request(make_request("b", 30, max_tokens=1))
        out, _ = step(scheduler, worker)
        assert out.num_scheduled_tokens == expected, policy
        run_to_completion(scheduler, worker)


def test_v0_waits_for_a_budget_that_holds_the_whole_prompt() -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=20, max_model_len=20, scheduling_policy="v0")
    scheduler.add_request(make_request("a", 15, max_tokens=1))
    scheduler.add_request(make_request("b", 10, max_tokens=1))
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 15}  # b is not chunked into the 5 left
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"b": 10}


# ---------------------------------------------------------------- limits


def test_long_prefill_token_threshold_caps_each_requests_chunk() -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    scheduler.add_request(make_request("a", 23, max_tokens=2))
    scheduler.add_request(make_request("b", 12, max_tokens=2))
    scheduler.add_request(make_request("c", 3, max_tokens=2))
    chunks = []
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, worker)
        chunks.append(dict(out.num_scheduled_tokens))
    # Long prompts advance side by side, 5 tokens a step, instead of one taking the whole budget.
    assert chunks[:3] == [{"a": 5, "b": 5, "c": 3}, {"a": 5, "b": 5, "c": 1}, {"a": 5, "b": 2}]
    assert [c.get("a") for c in chunks[3:5]] == [5, 3]
    assert all(max(c.values()) <= 5 for c in chunks)


def test_request_that_could_never_fit_the_kv_cache_is_rejected_at_admission() -> None:
    # 4 blocks of 4 = 16 tokens in the whole cache.
    scheduler, worker = make_scheduler(num_gpu_blocks=4, block_size=4, max_model_len=1024)
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        scheduler.add_request(make_request("too-long", 10, max_tokens=7))
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        scheduler.add_request(make_request("unbounded", 2, max_tokens=None))  # may reach max_model_len
    scheduler.add_request(make_request("fits", 10, max_tokens=6))
    assert scheduler.get_num_unfinished_requests() == 1
    assert len(run_to_completion(scheduler, worker).tokens("fits")) == 6

    scheduler, worker = make_scheduler(num_gpu_blocks=4, block_size=4, max_model_len=16)
    scheduler.add_request(make_request("capped-by-max-model-len", 2, max_tokens=None))
    assert len(run_to_completion(scheduler, worker).tokens("capped-by-max-model-len")) == 14


# ---------------------------------------------------------------- stats


def test_stats_count_tokens_requests_and_cache_usage() -> None:
    scheduler, worker = make_scheduler(num_gpu_blocks=10, block_size=4, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 10, max_tokens=3))
    scheduler.add_request(make_request("b", 3, max_tokens=2))
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 2, 0.0)
    step(scheduler, worker)  # a: 8 of 10 prompt tokens; b waits for budget
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(2 / 10)
    assert stats.num_prefill_tokens == 8 and stats.num_generation_tokens == 0
    run_to_completion(scheduler, worker)
    stats = scheduler.make_stats()
    assert stats.num_prefill_tokens == 10 + 3  # decodes are not prefill
    assert stats.num_generation_tokens == 3 + 2
    assert (stats.num_finished_reqs, stats.num_preemptions, stats.kv_cache_usage) == (2, 0, 0.0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prefix_cache_hit_rate) == (13, 0, 0.0)


@pytest.mark.parametrize("policy", ["fcfs", "v0"])
def test_a_batch_coming_in_parts_is_scheduled_as_if_whole(policy: str) -> None:
    """The engine hands a large batch to the scheduler in parts (EngineCoreProc._BatchPart): parts
    may come in before any step, and whenever the waiting queue runs out with room left in a step,
    await_more_requests adds the next one. Whatever the timing, every step is the one the whole
    batch would have made: random arrival points over several seeds give the same steps and
    tokens as the batch added at once (prompts share prefixes, so prefix-cache hits vary too)."""
    budget = 48 if policy == "fcfs" else 64
    config = dict(num_gpu_blocks=96, block_size=4, max_num_batched_tokens=budget, max_num_seqs=6,
                  scheduling_policy=policy, max_model_len=128)
    prompts = random_prompts(random.Random(11), 20, 2, 40)
    requests = [make_request(f"r{i}", prompt_token_ids=p, max_tokens=1 + i % 5) for i, p in enumerate(prompts)]

    whole_scheduler, worker = make_scheduler(**config)
    for request in requests:
        whole_scheduler.add_request(request)
    whole = run_to_completion(whole_scheduler, worker, pipelined=True)

    awaited_total = 0
    for seed in range(6):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(requests)), 5))
        parts = [requests[a:b] for a, b in zip([0, *cuts], [*cuts, len(requests)])]
        scheduler, worker = make_scheduler(**config)

        def add_next_part() -> bool:
            if not parts:
                return False
            for request in parts.pop(0):
                scheduler.add_request(request)
            return True

        def awaited() -> bool:
            nonlocal awaited_total
            awaited_total += bool(parts)
            return add_next_part()

        scheduler.await_more_requests = awaited
        add_next_part()
        run = run_to_completion(scheduler, worker, pipelined=True,
                                before_schedule=lambda: rng.random() < 0.3 and add_next_part())
        assert run.scheduler_outputs == whole.scheduler_outputs
        assert run.outputs == whole.outputs
    assert awaited_total > 0  # the scheduler did wait for parts

    # Without the wait the steps depend on the arrival points: the property above is not trivial.
    scheduler, worker = make_scheduler(**config)
    parts = [requests[:1], requests[1:]]
    add_next_part()
    first = scheduler.schedule()
    assert first.total_num_scheduled_tokens == len(prompts[0]) < whole.scheduler_outputs[0].total_num_scheduled_tokens
    scheduler.abort_requests([requests[0].request_id])
