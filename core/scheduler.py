"""Scheduler: hands out a per-step token budget to requests (vLLM V1 style, no phases).

Every request has `num_computed_tokens` catching up with `num_tokens`. Each step, running
requests are served first (one token when decoding, a chunk when still prefilling), then waiting
requests are admitted first-come first-served while budget and seats remain. A request whose
scheduled range reaches `num_tokens` gets one sampled token back from the worker.
When the cache runs out, the latest running request is preempted by recompute: it loses its
blocks and goes back to the front of the waiting queue, keeping its generated tokens.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from core.kv_cache_manager import KVCacheManager
from core.request import Request, RequestStatus
from protocol.config import EngineConfig
from protocol.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreRequest,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: EngineConfig, num_gpu_blocks: int) -> None:
        self.config = config
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.block_size = config.block_size
        self.kv_cache_manager = KVCacheManager(config.block_size, num_gpu_blocks)

        # Live (unfinished) requests by id.
        self.requests: dict[str, Request] = {}
        # WAITING and PREEMPTED requests; preempted ones go back to the front.
        self.waiting: deque[Request] = deque()
        # RUNNING requests in admission order; the last one is preempted first.
        self.running: list[Request] = []
        # Ids the worker should forget, reported in the next step that schedules work
        # (the engine does not send empty steps to the worker, so they must not be lost there).
        self.finished_req_ids: list[str] = []
        self.preempted_req_ids: list[str] = []

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, engine_core_request: EngineCoreRequest) -> None:
        request = Request.from_engine_core_request(engine_core_request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        # Either would never make progress: nothing to run, or more KV than the model allows.
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_prompt_tokens} prompt tokens, "
                f"more than max_model_len={self.max_model_len}"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Finish live requests as aborted and free their blocks now; other ids are ignored."""
        outputs: list[EngineCoreOutput] = []
        aborted: set[str] = set()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request_id in aborted:
                continue
            aborted.add(request_id)
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)
            outputs.append(
                EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason=request.finish_reason)
            )
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_reqs: list[Request] = []
        cached_reqs: list[tuple[Request, list[int]]] = []
        preempted_this_step = False

        # Running requests first, in order, so decodes are never starved by new prompts.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            if num_new_tokens <= 0:  # nothing to run until it gets a new token
                req_index += 1
                continue
            while True:
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                if new_block_ids is not None:
                    break
                # Out of blocks: preempt the latest request. It is never one already scheduled
                # this step, since those all sit before req_index.
                victim = self.running.pop()
                self._preempt(victim)
                preempted_this_step = True
                if victim is request:
                    break
            if new_block_ids is None:
                break  # the request preempted itself; everything after it is gone too
            cached_reqs.append((request, new_block_ids))
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # Then waiting requests, first come first served. Not after a preemption: the blocks
        # just freed are for the running requests, and admitting would only thrash.
        if not preempted_this_step:
            while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
                if self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
                    break  # keep FCFS order: nobody jumps ahead of the head of the queue
                self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                new_reqs.append(request)
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens

        total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        assert total_num_scheduled_tokens <= self.max_num_batched_tokens
        assert len(self.running) <= self.max_num_seqs

        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=list(request.prompt_token_ids),
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                )
                for request in new_reqs
            ],
            scheduled_cached_reqs=[
                CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens)
                for request, new_block_ids in cached_reqs
            ],
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            finished_req_ids=[],
            preempted_req_ids=[],
        )
        # Report finished/preempted ids only in a step the worker will see.
        if total_num_scheduled_tokens > 0:
            scheduler_output.finished_req_ids = self.finished_req_ids
            scheduler_output.preempted_req_ids = self.preempted_req_ids
            self.finished_req_ids = []
            self.preempted_req_ids = []

        # The worker will compute these tokens; count them now so the next schedule() sees them.
        for request_id, num_tokens in num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_tokens
        return scheduler_output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append each sampled token, stop the requests that are done, report what changed."""
        outputs: list[EngineCoreOutput] = []
        finished: set[str] = set()
        for request_id, token_id in zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids):
            request = self.requests.get(request_id)
            # Aborted (or otherwise gone) since the step was scheduled: drop its token.
            if (
                request is None
                or request.status != RequestStatus.RUNNING
                or request_id not in scheduler_output.num_scheduled_tokens
            ):
                continue
            request.output_token_ids.append(token_id)
            if self._check_stop(request, token_id):
                finished.add(request_id)
                self._free_request(request)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[token_id],
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                )
            )
        if finished:
            self.running = [request for request in self.running if request.request_id not in finished]
        return outputs

    # ------------------------------------------------------------------ helpers

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Set a finished status if `token_id` (just appended) ends the request."""
        params = request.sampling_params
        if token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
        elif not params.ignore_eos and token_id in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
        elif params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
        elif request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
        return request.is_finished

    def _preempt(self, request: Request) -> None:
        """Recompute-preemption: drop the request's KV; it restarts from token 0 later."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.preempted_req_ids.append(request.request_id)
        logger.debug(
            "preempted %s (preemption #%d, %d tokens to recompute)",
            request.request_id,
            request.num_preemptions,
            request.num_tokens,
        )

    def _free_request(self, request: Request) -> None:
        """Forget a finished request: its blocks go back now; the worker hears of it next step."""
        assert request.is_finished
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.append(request.request_id)
