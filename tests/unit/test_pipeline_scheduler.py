"""The scheduler under pipeline parallelism (no torch for the scheduler part): with two batches in
flight no request whose next token is still being computed is scheduled again, a batch takes its
share of the live requests, and the stages that do not sample learn every token they run from
CachedRequestData.new_token_ids -- through chunked prefill, preemption and prefix caching.
"""

from __future__ import annotations

from collections import deque

from minivllm.protocol.messages import ModelRunnerOutput, SchedulerOutput, unpack_token_ids

from tests.unit.scheduler_harness import check_invariants, make_request, make_scheduler


class NonSamplingStage:
    """What a pipeline stage before the last knows of each request: the tokens it was sent."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.num_prompt: dict[str, int] = {}

    def run(self, out: SchedulerOutput, last_stage_tokens: dict[str, list[int]]) -> None:
        for req_id in out.finished_req_ids + out.preempted_req_ids:
            self.tokens.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = unpack_token_ids(new.prompt_token_ids) + new.output_token_ids
            self.num_prompt[new.req_id] = new.num_prompt_tokens
        for cached in out.scheduled_cached_reqs:  # as worker/pipeline.py apply_new_token_ids
            known = self.tokens[cached.req_id]
            start = max(cached.num_computed_tokens, self.num_prompt[cached.req_id])
            end = start + len(cached.new_token_ids)
            assert len(known) >= start, "a gap in what this stage was sent"
            known[start:end] = cached.new_token_ids
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            computed = next((c.num_computed_tokens for c in out.scheduled_cached_reqs if c.req_id == req_id), None)
            if computed is None:
                computed = next(n.num_computed_tokens for n in out.scheduled_new_reqs if n.req_id == req_id)
            end = computed + num_tokens
            # Every token this step runs is known here, and it is the one the last stage has.
            assert self.tokens[req_id][:end] == last_stage_tokens[req_id][:end], req_id


def run_pipelined(num_gpu_blocks: int, requests, **config) -> tuple[dict[str, list[int]], int, list[int], int]:
    """Drive the scheduler as the EngineCore does with pipeline_parallel_size=2: up to two batches
    in flight, the older one's tokens taken after the newer was submitted."""
    scheduler, last_stage = make_scheduler(num_gpu_blocks=num_gpu_blocks, pipeline_parallel_size=2, **config)
    first_stage = NonSamplingStage()
    for request in requests:
        scheduler.add_request(request)
    in_flight: deque = deque()
    tokens: dict[str, list[int]] = {}
    batch_sizes: list[int] = []
    overlapped = 0
    while scheduler.has_unfinished_requests() or in_flight:
        if len(in_flight) < 2 and scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            check_invariants(scheduler, out)
            if out.total_num_scheduled_tokens:
                for _, older_result in in_flight:  # a request sampling in a batch in flight is not in this one
                    assert not set(older_result.req_ids) & set(out.num_scheduled_tokens), "a request in two batches"
                overlapped += bool(in_flight)
                result = last_stage.execute(out)  # stages run batches in submission order
                first_stage.run(out, {r: s.token_ids for r, s in last_stage.states.items()})
                in_flight.append((out, result))
                batch_sizes.append(len(out.num_scheduled_tokens))
                if len(in_flight) < 2:
                    continue
            else:
                scheduler.update_from_output(out, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        if in_flight:
            out, result = in_flight.popleft()
            for o in scheduler.update_from_output(out, result):
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens, overlapped, batch_sizes, scheduler.num_preemptions


def test_batches_split_the_requests_and_overlap() -> None:
    requests = [make_request(f"r{i}", num_prompt_tokens=8, max_tokens=6) for i in range(6)]
    tokens, overlapped, batch_sizes, _ = run_pipelined(256, requests)
    assert all(len(t) == 6 for t in tokens.values()) and len(tokens) == 6
    assert max(batch_sizes) == 3  # half of the six live requests per batch
    assert overlapped >= 8


def test_chunked_prefill_preemption_and_prefix_caching_keep_the_stages_in_step() -> None:
    shared = list(range(100, 124))
    requests = [make_request(f"r{i}", prompt_token_ids=shared + [200 + i] * (3 + 7 * i), max_tokens=10)
                for i in range(5)]
    requests.append(make_request("long", num_prompt_tokens=70, max_tokens=5))
    # 4-token blocks: 40 of them hold a few requests at a time, so some are preempted.
    scheduler_tokens, overlapped, _, num_preemptions = run_pipelined(40, requests, max_num_batched_tokens=16)
    assert num_preemptions > 0
    assert {r: len(t) for r, t in scheduler_tokens.items()} == {**{f"r{i}": 10 for i in range(5)}, "long": 5}
    assert overlapped > 0


def test_pp_layer_range_splits_every_layer_once() -> None:
    from minivllm.worker.distributed import pp_layer_range

    assert [pp_layer_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [pp_layer_range(36, r, 2) for r in range(2)] == [(0, 18), (18, 36)]
    for layers in range(1, 10):
        for stages in range(1, layers + 1):
            ranges = [pp_layer_range(layers, r, stages) for r in range(stages)]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            sizes = [end - start for start, end in ranges]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
            assert sizes[-1] == min(sizes)  # the last stage (LM head, sampling) never gets an extra layer
