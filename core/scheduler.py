"""Scheduler: hands out a per-step token budget to requests (vLLM V1 style, no phases).

Every request has `num_computed_tokens` catching up with `num_tokens`. Each step, running
requests are served first (one token when decoding, a chunk when still prefilling), then waiting
requests are admitted in queue order while budget and seats remain. A request whose scheduled
range reaches `num_tokens` gets one sampled token back from the worker.

- A newly admitted request starts past the longest run of its full blocks already in the
  prefix cache (their tokens count as computed).
- When the cache runs out, the running request that matters least — the last admitted (fcfs), or
  the lowest priority, latest arrived (priority) — is preempted by recompute: it loses its blocks
  and goes back to waiting, keeping its generated tokens; its cached blocks usually let it skip
  most of the recomputation.
- scheduling_policy="v0" is the pre-V1 scheduler, kept to compare against: a step either
  prefills whole prompts of waiting requests (and nothing else), or decodes every running one.
- With a KV connector (core/kv_connector/base.py has the contract) a request being admitted may
  take tokens' KV from outside (the CPU offload tier, a swapped-out copy of its own KV, another
  engine); when that KV arrives asynchronously the request waits in WAITING_FOR_REMOTE_KVS
  holding its blocks. A finished request's blocks may stay held until the connector has sent
  them. Without a connector none of this code runs.
- Speculative decoding (config.speculative_config): after a step the worker proposes draft tokens
  for the requests that sampled (Request.spec_token_ids). A decoding request then runs 1 + k
  tokens (its last known token and the drafts, trimmed to the budget, max_tokens and
  max_model_len); num_computed_tokens is advanced over all of them and, once the worker reports
  how many drafts it accepted, pulled back over the rejected ones, whose whole tail blocks are
  freed. Drafts never become known tokens until accepted, so prefix-cache hashes cover verified
  tokens only. With async scheduling a speculating request is step-synchronous: it is not
  scheduled again until its tokens (and the next drafts, which depend on them) are back; requests
  without drafts keep running a step ahead. Speculation steps aside while more than
  disable_by_batch_size requests run (a verify step's extra tokens then cost what they save).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import msgspec

from minivllm.core.block_pool import KVCacheBlock
from minivllm.core.kv_cache_manager import KVCacheManager, cdiv
from minivllm.core.kv_connector import make_scheduler_connector
from minivllm.core.request import Request, RequestStatus
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.kv_transfer import KVConnectorMetadata, KVConnectorOutput
from minivllm.protocol.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreRequest,
    ERROR_KV_TRANSFER,
    EngineStats,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)
_encode = msgspec.msgpack.Encoder().encode


def _priority_key(request: Request) -> tuple[int, float, int]:
    """Lower runs first: priority, then arrival."""
    return (request.priority, request.arrival_time, request.arrival_order)


class FCFSRequestQueue:
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityRequestQueue:
    """Waiting requests by (priority, arrival): a heap. A preempted request goes back by its
    key too, so it is ahead of everything that arrived after it at its priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []

    def add(self, request: Request) -> None:
        # arrival_order is unique, so comparisons never reach the Request itself.
        heapq.heappush(self._heap, (_priority_key(request), request))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not request]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in sorted(self._heap))

    def __len__(self) -> int:
        return len(self._heap)


@dataclass
class _StepPlan:
    """One step's decisions so far."""

    token_budget: int
    max_reqs: int = 1 << 62  # requests per step (pipeline parallelism caps it; else max_num_seqs does)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    # Running requests scheduled again, with the ids of the blocks they gained this step.
    cached_reqs: list[tuple[Request, list[int]]] = field(default_factory=list)
    # Speculative decoding: whether this step verifies drafts / proposes new ones, and the drafts
    # scheduled per request (part of their num_scheduled_tokens).
    speculating: bool = False
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)

    def schedule(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, num_gpu_blocks: int) -> None:
        self.config = config
        self.policy = config.scheduling_policy
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        # Pipeline parallelism: a request whose next token is still being computed in a batch in
        # flight is not scheduled again until it arrives (the first stages cannot have it yet).
        self.pipeline_parallel = config.pipeline_parallel_size > 1
        self.pipeline_parallel_size = config.pipeline_parallel_size
        self.block_size = config.block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.kv_cache_manager = KVCacheManager(
            config.block_size, num_gpu_blocks, enable_caching=config.enable_prefix_caching
        )

        # Live (unfinished) requests by id.
        self.requests: dict[str, Request] = {}
        # WAITING and PREEMPTED requests, in the order the policy admits them.
        self.waiting = PriorityRequestQueue() if self.policy == "priority" else FCFSRequestQueue()
        # RUNNING requests, served in this order; the last one is preempted first. fcfs / v0:
        # admission order. priority: sorted by (priority, arrival), so a victim is never a
        # request already scheduled in the step (all of those come before it).
        self.running: list[Request] = []
        self._arrival_counter = itertools.count()
        # Ids the worker should forget, reported in the next step that schedules work
        # (the engine does not send empty steps to the worker, so they must not be lost there).
        self.finished_req_ids: list[str] = []
        self.preempted_req_ids: list[str] = []
        # The requests each step in flight scheduled, by step id: a token coming back is only
        # taken by the very request it was computed for (an id may be reused once it finishes).
        self.step_counter = itertools.count()
        self.scheduled_requests: dict[int, dict[str, Request]] = {}

        # Speculative decoding (num_spec_tokens 0: off, and none of it runs).
        spec = config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.spec_disable_by_batch_size = 0
        # A draft model writes the KV of the k tokens it proposes past the verified ones: the slots
        # for them are allocated with the step (vLLM's lookahead slots).
        self.num_lookahead_tokens = 0
        if spec is not None:
            self.spec_disable_by_batch_size = spec.max_speculating_batch
            self.num_lookahead_tokens = self.num_spec_tokens if spec.method == "draft_model" else 0
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

        # Counters since start, for EngineStats.
        self.num_preemptions = 0
        self.num_prefill_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished_reqs = 0

        # KV connector (None: none configured, and none of the state below is ever used).
        self.connector = make_scheduler_connector(config, num_gpu_blocks)
        if self.connector is not None:
            self.connector.bind_block_pool(self.kv_cache_manager.block_pool)
            self.connector.bind_block_ids(self.kv_cache_manager.get_block_ids)
        # Requests in WAITING_FOR_REMOTE_KVS, by id.
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        # Finished requests whose blocks the connector still reads (a send) or writes (a load in
        # flight when they were aborted): id -> (blocks, deadline).
        self.held_blocks: dict[str, tuple[list[KVCacheBlock], float]] = {}
        # Ids whose transfers were given up on, for the next KVConnectorMetadata.
        self.expired_req_ids: list[str] = []
        # Outputs the KV connector's events made (a failed load, a first token that came with the
        # KV), for the next update_from_output.
        self.kv_outputs: list[EngineCoreOutput] = []
        # With defer_block_updates (the engine's busy loop sets it), two kinds of block bookkeeping
        # wait for apply_deferred_block_updates(), which the loop calls once a step is submitted and
        # its outputs are sent, so that neither sits between the GPU and the client:
        #   - freeing the blocks of requests that finished (or were aborted): a Python loop over
        #     them (a 32k-token request's 2,000: ~0.8 ms) between the GPU's last token and the client;
        #   - registering the blocks a step fills in the prefix cache (KVCacheManager.defer_caching):
        #     hashing a 16k-token chunk's 1,024 blocks between the scheduler and the GPU.
        # The next schedule() applies them first, and every prefix-cache lookup registers what
        # waits, so no step is scheduled differently. Not with a KV connector.
        self._defer_block_updates = False
        self._finished_blocks: list[list[KVCacheBlock]] = []
        # Called when the waiting queue runs out while a step still has room (None: never). The
        # engine sets it where a batch reaches the scheduler in parts (EngineCoreProc): it waits for
        # the batch's next part, adds its requests and returns whether it added any, so that a step
        # never depends on how much of a batch had arrived. Only for queue-order policies without
        # pipeline parallelism, whose steps look at the waiting queue only through this loop.
        self.await_more_requests: Callable[[], bool] | None = None

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, engine_core_request: EngineCoreRequest) -> None:
        request = Request.from_engine_core_request(engine_core_request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        # Each of these would never make progress: nothing to run, more KV than the model
        # allows, or more KV than the whole cache holds (it would wait, or preempt itself,
        # forever). Frontends check the same first; this guards the engine.
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_prompt_tokens} prompt tokens, "
                f"more than max_model_len={self.max_model_len}"
            )
        max_num_tokens = self._max_num_tokens(request)
        if cdiv(max_num_tokens, self.block_size) > self.num_gpu_blocks:
            raise ValueError(
                f"request {request.request_id!r} may grow to {max_num_tokens} tokens, more than the "
                f"KV cache holds ({self.num_gpu_blocks} blocks x {self.block_size} tokens)"
            )
        if self.connector is not None:
            if request.request_id in self.held_blocks:
                raise ValueError(f"request id {request.request_id!r} is still in use (its KV is being "
                                 "transferred); give each request its own id")
            self.connector.validate_kv_transfer_params(request)
        request.arrival_order = next(self._arrival_counter)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _max_num_tokens(self, request: Request) -> int:
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            return self.max_model_len
        return min(request.num_prompt_tokens + max_tokens, self.max_model_len)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Finish live requests as aborted and free their blocks (now; with defer_block_updates, at
        the next apply_deferred_block_updates or schedule); other ids are ignored."""
        outputs: list[EngineCoreOutput] = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:  # unknown, finished, or already aborted (a repeated id)
                continue
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif loading:
                del self.waiting_for_remote_kvs[request_id]
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            kv_transfer_params = self._free_request(request, load_in_flight=loading)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    finish_reason=request.finish_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    kv_transfer_params=kv_transfer_params,
                )
            )
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Whether steps are still needed: live requests, or blocks held for a KV transfer."""
        return bool(self.requests) or bool(self.held_blocks)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def defer_block_updates(self) -> bool:
        return self._defer_block_updates

    @defer_block_updates.setter
    def defer_block_updates(self, defer: bool) -> None:
        self._defer_block_updates = defer
        self.kv_cache_manager.defer_caching = defer and self.connector is None

    def num_deferred_block_updates(self) -> int:
        """About how many blocks apply_deferred_block_updates() would go through: the finished
        requests' and those waiting to be registered."""
        return sum(map(len, self._finished_blocks)) + self.kv_cache_manager.num_deferred_blocks()

    def apply_deferred_block_updates(self) -> None:
        """Register the filled blocks and give back the finished requests' blocks that
        defer_block_updates put off (a no-op if none wait)."""
        self.kv_cache_manager.cache_deferred_blocks()
        for blocks in self._finished_blocks:
            self.kv_cache_manager.free_blocks(blocks)
        self._finished_blocks.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; only while no request holds blocks. Returns success."""
        self.apply_deferred_block_updates()
        if not self.kv_cache_manager.reset_prefix_cache():
            return False
        if self.connector is not None:
            self.connector.reset_prefix_cache()
        return True

    def make_stats(self) -> EngineStats:
        self.apply_deferred_block_updates()
        manager = self.kv_cache_manager
        return EngineStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_remote_kvs),
            kv_cache_usage=manager.usage,
            num_gpu_blocks=self.num_gpu_blocks,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=manager.prefix_cache_queries,
            prefix_cache_hits=manager.prefix_cache_hits,
            num_prefill_tokens=self.num_prefill_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_finished_reqs=self.num_finished_reqs,
            spec_decode_num_drafts=self.spec_num_drafts,
            spec_decode_num_draft_tokens=self.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_num_accepted_tokens_per_pos),
        )

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        self.apply_deferred_block_updates()
        if self.connector is not None and (self.waiting_for_remote_kvs or self.held_blocks):
            self._expire_kv_transfers(time.monotonic())
        plan = _StepPlan(token_budget=self.max_num_batched_tokens)
        plan.speculating = self.num_spec_tokens > 0 and len(self.running) <= self.spec_disable_by_batch_size
        if self.pipeline_parallel:
            # A batch takes its share of the live requests: with all of them in one batch the
            # next would be empty (none may be in two at once) and the stages would take turns.
            plan.max_reqs = cdiv(min(len(self.running) + len(self.waiting), self.max_num_seqs),
                                 self.pipeline_parallel_size)
        if self.policy == "v0":
            # Prefills first, whole prompts only; a step that admits anything does nothing else.
            # Running requests wait meanwhile: the stall V1 removes.
            self._schedule_waiting(plan, whole_prompts_only=True)
            if not plan.new_reqs:
                self._schedule_running(plan)
        else:
            # Running requests first, so decodes are never starved by new prompts. No admission
            # after a preemption: the blocks just freed are for the running requests, and
            # admitting would only thrash.
            if not self._schedule_running(plan):
                self._schedule_waiting(plan, whole_prompts_only=False)
        scheduler_output = self._make_scheduler_output(plan)
        if self.connector is not None:
            self._attach_connector_metadata(scheduler_output)
        return scheduler_output

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        """Tokens to run for a request this step: what it lacks (tokens still being sampled
        count as known), capped per request by long_prefill_token_threshold and by what is left
        of the budget."""
        num_new_tokens = request.num_tokens + request.num_output_placeholders - num_computed_tokens
        if 0 < self.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = self.long_prefill_token_threshold
        return min(num_new_tokens, token_budget)

    def _schedule_running(self, plan: _StepPlan) -> bool:
        """Serve running requests in order, preempting from the back when blocks run out.
        Returns whether anything was preempted."""
        preempted = False
        req_index = 0
        while (req_index < len(self.running) and plan.token_budget > 0
               and len(plan.num_scheduled_tokens) < plan.max_reqs):
            request = self.running[req_index]
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, plan.token_budget)
            if num_new_tokens <= 0 or self._finishes_in_flight(request) or (
                    self.pipeline_parallel and request.num_output_placeholders):  # nothing to run for now
                req_index += 1
                continue
            drafts: list[int] = []
            num_lookahead_tokens = 0
            if plan.speculating and request.can_speculate:
                if request.num_output_placeholders:  # its next drafts come with its tokens: wait
                    req_index += 1
                    continue
                if num_new_tokens == 1:  # decoding
                    drafts = self._trim_drafts(request, plan.token_budget)
                    num_new_tokens += len(drafts)
                    num_lookahead_tokens = self._num_lookahead_tokens(request, num_new_tokens)
            while True:
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens + num_lookahead_tokens)
                if new_block_ids is not None:
                    break
                if self.connector is not None:
                    # Out of blocks: waiting requests holding loaded KV give theirs up first.
                    if self._release_loaded_blocks(only_one=True):
                        continue
                    # Rather than preempt itself, the last running request waits for the loads in
                    # flight to land: their blocks are given up then (as above).
                    if self.running[-1] is request and self.waiting_for_remote_kvs:
                        preempted = True  # as after a preemption: no admission in this step
                        break
                # Out of blocks: preempt the last running request. It is never one already
                # scheduled this step, since those all sit before req_index.
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_block_ids is None:
                break  # the request preempted itself; everything after it is gone too
            plan.cached_reqs.append((request, new_block_ids))
            plan.schedule(request, num_new_tokens)
            if drafts:
                plan.spec_tokens[request.request_id] = drafts
            if request.spec_token_ids:
                request.spec_token_ids = []
            req_index += 1
        return preempted

    def _trim_drafts(self, request: Request, token_budget: int) -> list[int]:
        """The request's drafts that fit: the step's budget after its own token, and no more
        tokens than max_tokens and max_model_len allow even if all are accepted (+1 bonus)."""
        num_drafts = min(len(request.spec_token_ids), token_budget - 1,
                         self.max_model_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            num_drafts = min(num_drafts, max_tokens - request.num_output_tokens - 1)
        return request.spec_token_ids[:max(num_drafts, 0)]

    def _num_lookahead_tokens(self, request: Request, num_new_tokens: int) -> int:
        """Slots past the scheduled tokens for the draft model's own proposals (within the
        request's maximum length, so no request ever needs more blocks than admission checked)."""
        if not self.num_lookahead_tokens:
            return 0
        end = request.num_computed_tokens + num_new_tokens
        return max(0, min(self.num_lookahead_tokens, self._max_num_tokens(request) - end))

    def _finishes_in_flight(self, request: Request) -> bool:
        """Whether the tokens still being sampled for a request bring it to max_tokens or
        max_model_len: then it finishes when they arrive, and running it on would be wasted."""
        if not request.num_output_placeholders:
            return False
        max_tokens = request.sampling_params.max_tokens
        num_output_tokens = request.num_output_tokens + request.num_output_placeholders
        return ((max_tokens is not None and num_output_tokens >= max_tokens)
                or request.num_tokens + request.num_output_placeholders >= self.max_model_len)

    def _attach_pp_token_ids(self, scheduler_output: SchedulerOutput, plan: _StepPlan) -> None:
        """Pipeline parallelism: the tokens each running request runs this step past its prompt,
        for the stages that do not sample (CachedRequestData.new_token_ids); the prompt they have."""
        for cached, (request, _) in zip(scheduler_output.scheduled_cached_reqs, plan.cached_reqs):
            start = max(request.num_computed_tokens, request.num_prompt_tokens)
            end = request.num_computed_tokens + scheduler_output.num_scheduled_tokens[request.request_id]
            if end > start:
                cached.new_token_ids = request.output_token_ids[start - request.num_prompt_tokens:
                                                                end - request.num_prompt_tokens]

    def _schedule_waiting(self, plan: _StepPlan, whole_prompts_only: bool) -> None:
        """Admit waiting requests in queue order while budget, seats and blocks last."""
        while (plan.token_budget > 0 and len(self.running) < self.max_num_seqs
               and len(plan.num_scheduled_tokens) < plan.max_reqs):
            if not self.waiting:
                if self.await_more_requests is None or not self.await_more_requests():
                    break
                continue  # (its requests may all have been refused: look again)
            request = self.waiting.peek()
            num_external_tokens = 0
            if request.num_computed_tokens:  # holds blocks: its KV was loaded by the connector
                computed_blocks, num_cached_tokens = [], 0
            else:
                computed_blocks, num_cached_tokens = self.kv_cache_manager.get_computed_blocks(request)
                if self.connector is not None and request.sampling_params.prompt_logprobs is None:
                    self.kv_cache_manager.hash_full_blocks(request)
                    num_external_tokens, load_async = self.connector.get_num_new_matched_tokens(
                        request, num_cached_tokens)
                    # The last known token is computed here, for its logits; unless an asynchronous
                    # load brings the token sampled after it (added when the load completes).
                    brings_token = load_async and self.connector.first_output_token(request) is not None
                    num_external_tokens = max(0, min(num_external_tokens,
                                                     request.num_tokens - (not brings_token) - num_cached_tokens))
                    if num_external_tokens and load_async:
                        if not self._start_async_load(request, computed_blocks, num_cached_tokens,
                                                      num_external_tokens):
                            break
                        continue
            num_computed_tokens = request.num_computed_tokens + num_cached_tokens + num_external_tokens
            if whole_prompts_only:
                num_new_tokens = request.num_tokens - num_computed_tokens
                if num_new_tokens > plan.token_budget:
                    break
            else:
                num_new_tokens = self._num_new_tokens(request, num_computed_tokens, plan.token_budget)
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_external_tokens + num_new_tokens, num_cached_tokens, computed_blocks
            )
            if new_block_ids is None:
                if self.connector is not None and not self.running:
                    self._release_loaded_blocks(but=request)  # see _release_loaded_blocks
                break  # keep queue order: nobody jumps ahead of the head of the queue
            self.waiting.pop()
            if request.num_cached_tokens < 0:  # first admission, not a resumption
                request.num_cached_tokens = num_cached_tokens + num_external_tokens
                self.kv_cache_manager.record_prefix_cache_lookup(request.num_tokens, num_cached_tokens)
            if num_external_tokens:  # loaded by the worker in this step, before the forward
                request.num_computed_tokens = num_cached_tokens
                self.connector.update_state_after_alloc(
                    request, self.kv_cache_manager.get_block_ids(request.request_id), num_external_tokens)
            request.num_computed_tokens = num_computed_tokens
            request.status = RequestStatus.RUNNING
            if self.policy == "priority":
                bisect.insort(self.running, request, key=_priority_key)
            else:
                self.running.append(request)
            plan.new_reqs.append(request)
            plan.schedule(request, num_new_tokens)

    def _make_scheduler_output(self, plan: _StepPlan) -> SchedulerOutput:
        num_scheduled_tokens = plan.num_scheduled_tokens
        total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        assert total_num_scheduled_tokens <= self.max_num_batched_tokens
        assert len(self.running) <= self.max_num_seqs

        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.packed_prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                    eos_token_ids=list(request.eos_token_ids),
                )
                for request in plan.new_reqs
            ],
            scheduled_cached_reqs=[
                CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens,
                                  request.num_released_blocks)
                for request, new_block_ids in plan.cached_reqs
            ],
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            finished_req_ids=[],
            preempted_req_ids=[],
            step_id=next(self.step_counter),
            scheduled_spec_decode_tokens=plan.spec_tokens,
            propose_drafts=plan.speculating,
        )
        for request, _ in plan.cached_reqs:
            request.num_released_blocks = 0
        if self.pipeline_parallel:
            self._attach_pp_token_ids(scheduler_output, plan)
        # Report finished/preempted ids only in a step the worker will see.
        if total_num_scheduled_tokens > 0:
            scheduler_output.finished_req_ids = self.finished_req_ids
            scheduler_output.preempted_req_ids = self.preempted_req_ids
            self.finished_req_ids = []
            self.preempted_req_ids = []

        # The worker will compute these tokens; count them now so the next schedule() sees them.
        # On the way, count the decode tokens: a running request's one token sampled last step (and
        # its drafts); everything else scheduled is prefill (prompt chunks, or a preempted
        # request's recomputation).
        new_req_ids = {request.request_id for request in plan.new_reqs}
        num_decode_tokens = 0
        scheduled: dict[str, Request] = {}
        for request_id, num_tokens in num_scheduled_tokens.items():
            request = scheduled[request_id] = self.requests[request_id]
            num_drafts = len(plan.spec_tokens.get(request_id, ()))
            num_known_tokens = request.num_tokens + request.num_output_placeholders
            if (request.num_computed_tokens == num_known_tokens - 1 and num_known_tokens > request.num_prompt_tokens
                    and request_id not in new_req_ids):
                num_decode_tokens += 1 + num_drafts
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens - num_drafts == num_known_tokens:
                request.num_output_placeholders += 1  # this step samples its next token
        self.num_prefill_tokens += total_num_scheduled_tokens - num_decode_tokens
        self.scheduled_requests[scheduler_output.step_id] = scheduled
        return scheduler_output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append each sampled token, stop the requests that are done, report what changed.

        With async scheduling the next step is already scheduled (and maybe running) when this is
        called; a request finished here may be in it, its extra token is dropped when it arrives.
        """
        outputs: list[EngineCoreOutput] = []
        if model_runner_output.kv_connector_output is not None:
            self._update_from_kv_connector_output(model_runner_output.kv_connector_output)
        if self.kv_outputs:
            outputs, self.kv_outputs = self.kv_outputs, []
        finished: set[str] = set()
        scheduled = self.scheduled_requests.pop(scheduler_output.step_id, {})
        num_outputs = len(model_runner_output.req_ids)
        logprobs = model_runner_output.logprobs or [None] * num_outputs
        prompt_logprobs = model_runner_output.prompt_logprobs or [None] * num_outputs
        accepted_drafts = model_runner_output.accepted_draft_token_ids or [None] * num_outputs
        next_drafts = model_runner_output.spec_token_ids or [None] * num_outputs
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        for request_id, token_id, token_logprobs, token_prompt_logprobs, accepted, drafts in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, logprobs, prompt_logprobs,
            accepted_drafts, next_drafts,
        ):
            request = scheduled.get(request_id)
            # Finished, aborted or preempted since the step was scheduled: drop its token (a
            # preempted request recomputes from its known tokens and samples this one again).
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_output_placeholders -= 1
            new_token_ids = [token_id]
            if request_id in scheduled_drafts:
                accepted = accepted or []
                new_token_ids = [*accepted, token_id]
                self._count_verified_drafts(request, len(scheduled_drafts[request_id]), len(accepted))
            kv_transfer_params = None
            for i, new_token_id in enumerate(new_token_ids):
                request.output_token_ids.append(new_token_id)
                self.num_generation_tokens += 1
                if self._check_stop(request, new_token_id):
                    del new_token_ids[i + 1:]  # tokens past a stop are dropped
                    finished.add(request_id)
                    kv_transfer_params = self._free_request(request)
                    break
            else:
                request.spec_token_ids = drafts or []
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    new_logprobs=token_logprobs,
                    prompt_logprobs=token_prompt_logprobs,
                    kv_transfer_params=kv_transfer_params,
                )
            )
        if finished:
            self.running = [request for request in self.running if request.request_id not in finished]
        return outputs

    # ------------------------------------------------------------------ helpers

    def _count_verified_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify step's outcome: num_computed_tokens drops back over the rejected drafts (their
        KV slots are overwritten later), whole tail blocks they alone held are freed, and the
        acceptance counters move."""
        if num_accepted > num_drafts:
            raise RuntimeError(f"request {request.request_id}: {num_accepted} drafts accepted of {num_drafts}")
        num_rejected = num_drafts - num_accepted
        if num_rejected:
            request.num_computed_tokens -= num_rejected
            request.num_released_blocks += self.kv_cache_manager.free_tail_blocks(
                request, request.num_computed_tokens)
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.spec_num_accepted_tokens_per_pos[pos] += 1

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Set a finished status if `token_id` (just appended) ends the request (an unfinished one);
        returns whether it did. (Run per request and token: plain lengths, no properties.)"""
        params = request.sampling_params
        num_output_tokens = len(request.output_token_ids)
        # min_tokens: a stop token counts only once min_tokens tokens came before it (the sampler
        # holds them back until then too).
        if num_output_tokens > params.min_tokens:
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
        if ((params.max_tokens is not None and num_output_tokens >= params.max_tokens)
                or len(request.prompt_token_ids) + num_output_tokens >= self.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _preempt(self, request: Request) -> None:
        """Preemption: drop the request's KV; it restarts from token 0 later (or from past
        whatever of its blocks the prefix cache still holds by then). With a KV connector (swap
        preemption) the connector may copy the KV out first and offer it back on resumption."""
        if self.connector is not None:
            self.connector.request_preempted(request, self.kv_cache_manager.get_block_ids(request.request_id),
                                             min(request.num_computed_tokens, request.num_tokens))
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # Its tokens in flight are dropped when they arrive: the steps still in flight forget it
        # (with two steps ahead it may be running again by the time the later one reports).
        request.num_output_placeholders = 0
        for scheduled in self.scheduled_requests.values():
            scheduled.pop(request.request_id, None)
        request.spec_token_ids = []
        request.num_released_blocks = 0  # the worker forgets the request and its block table
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        self.preempted_req_ids.append(request.request_id)
        logger.debug(
            "preempted %s (preemption #%d, %d tokens to recompute)",
            request.request_id,
            request.num_preemptions,
            request.num_tokens,
        )

    def _free_request(self, request: Request, load_in_flight: bool = False) -> dict | None:
        """Forget a finished request: its blocks go back now (with defer_block_updates, at
        apply_deferred_block_updates; with a KV connector, once it is done with them); the worker
        hears of it next step. Returns the connector's kv_transfer_params for the client."""
        assert request.is_finished
        kv_transfer_params = None
        if self.connector is None and self.defer_block_updates:
            self._finished_blocks.append(self.kv_cache_manager.take_blocks(request))
        elif self.connector is None:
            self.kv_cache_manager.free(request)
        else:
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            delay_free, kv_transfer_params = self.connector.request_finished(request, block_ids)
            blocks = self.kv_cache_manager.take_blocks(request)
            # A load in flight writes the blocks until the worker reports it (or it expires).
            if (delay_free or load_in_flight) and blocks:
                self.held_blocks[request.request_id] = (blocks, time.monotonic() + self.connector.transfer_timeout_s)
            else:
                self.kv_cache_manager.free_blocks(blocks)
        del self.requests[request.request_id]
        self.finished_req_ids.append(request.request_id)
        self.num_finished_reqs += 1
        return kv_transfer_params

    # ------------------------------------------------------------------ KV connector (only with one)

    def _start_async_load(self, request: Request, computed_blocks: list[KVCacheBlock], num_cached_tokens: int,
                          num_external_tokens: int) -> bool:
        """Give a request blocks for tokens the connector loads asynchronously and park it in
        WAITING_FOR_REMOTE_KVS. Returns False (changing nothing) when the blocks are not there."""
        manager = self.kv_cache_manager
        if manager.allocate_slots(request, num_external_tokens, num_cached_tokens, computed_blocks,
                                  delay_cache_blocks=True) is None:
            if not self.running:
                self._release_loaded_blocks(but=request)
            return False
        self.waiting.pop()
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached_tokens + num_external_tokens
            manager.record_prefix_cache_lookup(request.num_tokens, num_cached_tokens)
        request.num_computed_tokens = num_cached_tokens
        request.num_loading_tokens = num_external_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.kv_transfer_deadline = time.monotonic() + self.connector.transfer_timeout_s
        self.waiting_for_remote_kvs[request.request_id] = request
        self.connector.update_state_after_alloc(request, manager.get_block_ids(request.request_id),
                                                num_external_tokens)
        logger.debug("%s waits for %d tokens' KV (%d computed here)", request.request_id, num_external_tokens,
                     num_cached_tokens)
        return True

    def _release_loaded_blocks(self, but: Request | None = None, only_one: bool = False) -> bool:
        """Give back the blocks of waiting requests whose KV a connector loaded (last queued
        first), which would otherwise keep the requests that need blocks out forever: a running
        request, or the head of the queue when nothing runs. They load or compute that KV again
        when their turn comes. Returns whether any were released."""
        released = False
        for request in reversed(list(self.waiting)):
            if request is not but and request.num_computed_tokens:
                # As a preemption: with swap the KV goes back to host memory.
                self.connector.request_preempted(request, self.kv_cache_manager.get_block_ids(request.request_id),
                                                 request.num_computed_tokens)
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                released = True
                logger.debug("released the loaded KV of waiting request %s to make room", request.request_id)
                if only_one:
                    break
        return released

    def _update_from_kv_connector_output(self, output: KVConnectorOutput) -> None:
        self.connector.update_connector_output(output)
        for request_id in output.finished_sending:
            held = self.held_blocks.pop(request_id, None)
            if held is not None:
                self.kv_cache_manager.free_blocks(held[0])
        received = []
        for request_id in output.finished_recving:
            held = self.held_blocks.pop(request_id, None)  # aborted while its KV was loading
            if held is not None:
                self.kv_cache_manager.free_blocks(held[0])
            request = self.waiting_for_remote_kvs.pop(request_id, None)
            if request is not None:
                received.append(request)
        # Back to the front of the queue (they hold blocks), in their order of arrival.
        for request in sorted(received, key=lambda r: r.arrival_order, reverse=True):
            request.num_computed_tokens += request.num_loading_tokens
            request.num_loading_tokens = 0
            if request.num_computed_tokens == request.num_tokens and self._take_first_output_token(request):
                continue  # it finished on that token
            request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
            self.waiting.prepend(request)
        for request_id in output.failed_recving:
            held = self.held_blocks.pop(request_id, None)
            if held is not None:
                self.kv_cache_manager.free_blocks(held[0])
            request = self.waiting_for_remote_kvs.pop(request_id, None)
            if request is not None:
                self._fail_kv_transfer(request, "its KV cache could not be loaded (the KV connector's transfer failed)")

    def _take_first_output_token(self, request: Request) -> bool:
        """A request whose whole prompt's KV was loaded appends the first output token that came
        with it and reports it, as a step would have. Returns whether that token finished it."""
        token_id = self.connector.first_output_token(request)
        request.output_token_ids.append(token_id)
        self.num_generation_tokens += 1
        kv_transfer_params = self._free_request(request) if self._check_stop(request, token_id) else None
        self.kv_outputs.append(EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[token_id], finish_reason=request.finish_reason,
            stop_reason=request.stop_reason, num_cached_tokens=max(request.num_cached_tokens, 0),
            kv_transfer_params=kv_transfer_params))
        return request.is_finished

    def _fail_kv_transfer(self, request: Request, reason: str) -> None:
        """Finish a request in WAITING_FOR_REMOTE_KVS with an error; its blocks are free to reuse
        (the worker side drops the transfer)."""
        logger.warning("request %s failed: %s", request.request_id, reason)
        request.status = RequestStatus.FINISHED_ABORTED
        self._free_request(request)
        self.kv_outputs.append(EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[], finish_reason=request.finish_reason,
            error_type=ERROR_KV_TRANSFER, error=f"request {request.request_id!r}: {reason}"))

    def _expire_kv_transfers(self, now: float) -> None:
        """Give up on transfers past the connector's transfer_timeout_s (a dead peer): a request
        waiting for its KV fails, held blocks are freed; the worker side is told to drop them."""
        timeout = self.connector.transfer_timeout_s
        for request_id, request in list(self.waiting_for_remote_kvs.items()):
            if request.kv_transfer_deadline <= now:
                del self.waiting_for_remote_kvs[request_id]
                self.expired_req_ids.append(request_id)
                self._fail_kv_transfer(request, f"its KV cache did not arrive within {timeout:g} s")
        for request_id, (blocks, deadline) in list(self.held_blocks.items()):
            if deadline <= now:
                del self.held_blocks[request_id]
                self.expired_req_ids.append(request_id)
                self.kv_cache_manager.free_blocks(blocks)
                logger.warning("request %s: its KV was not transferred within %g s; its blocks are freed",
                               request_id, timeout)

    def _attach_connector_metadata(self, scheduler_output: SchedulerOutput) -> None:
        """This step's connector metadata. A step with no tokens gets some only when the worker
        side has work or something to report; otherwise it is not sent at all, as without a
        connector."""
        meta = self.connector.build_connector_meta(scheduler_output)
        if (scheduler_output.total_num_scheduled_tokens == 0 and meta is None and not self.expired_req_ids
                and not self.waiting_for_remote_kvs and not self.held_blocks
                and not self.connector.has_pending_work()):
            return
        scheduler_output.kv_connector_metadata = KVConnectorMetadata(
            payload=b"" if meta is None else _encode(meta), expired_req_ids=self.expired_req_ids)
        self.expired_req_ids = []
