"""Request: the EngineCore's view of one generation, from arrival until it finishes."""

from __future__ import annotations

import enum

from minivllm.protocol.messages import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, EngineCoreRequest, pack_token_ids
from minivllm.protocol.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    # Pushed back to waiting by preemption; scheduled like WAITING.
    PREEMPTED = enum.auto()
    # Holds blocks into which a KV connector is loading its KV asynchronously; not scheduled
    # until the worker reports the load finished (vLLM's name).
    WAITING_FOR_REMOTE_KVS = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: FINISH_STOP,
    RequestStatus.FINISHED_LENGTH: FINISH_LENGTH,
    RequestStatus.FINISHED_ABORTED: FINISH_ABORT,
}


class Request:
    """Token ids known so far (prompt + output) and how many of them have KV in the cache.

    There are no prefill/decode phases: `num_computed_tokens` simply catches up with
    `num_tokens`, a chunk at a time while the prompt is long, one token a step after that.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        eos_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self._packed_prompt_token_ids: bytes | None = None
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_ids = list(eos_token_ids or [])
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # Order of arrival at the scheduler (set by it): breaks arrival_time ties.
        self.arrival_order = 0
        self.status = RequestStatus.WAITING
        # Tokens whose KV is in the cache (or will be once the step scheduled for them runs).
        self.num_computed_tokens = 0
        # Tokens sampled by steps still running in the workers, not yet known here (async
        # scheduling: the next step is scheduled before this one's tokens arrive). The scheduler
        # treats them as known for scheduling; the worker already has them when it runs that step.
        self.num_output_placeholders = 0
        self.num_preemptions = 0
        # Prompt tokens found in the prefix cache when first scheduled; -1 until then.
        self.num_cached_tokens = -1
        # Prefix-cache hashes of its full blocks so far (prompt and outputs). Tokens are only
        # ever appended, so these stay valid through preemption: a resumed request finds its
        # own blocks again if they were not evicted meanwhile.
        self.block_hashes: list[bytes] = []
        # The stop token id that finished the request, if one did.
        self.stop_reason: int | None = None
        # KV connector state: the client's (untrusted) parameters; while WAITING_FOR_REMOTE_KVS,
        # the tokens being loaded past num_computed_tokens and when the scheduler gives up on them.
        self.kv_transfer_params = kv_transfer_params
        self.num_loading_tokens = 0
        self.kv_transfer_deadline = 0.0
        # Speculative decoding: draft tokens the worker proposed after this request's last known
        # token, to be verified in its next step (never part of its known tokens); and how many of
        # its tail blocks were taken back since its last step (they held only rejected drafts).
        self.spec_token_ids: list[int] = []
        self.num_released_blocks = 0
        # Logprobs and logits processors see one position per step; such requests never speculate.
        params = sampling_params
        self.can_speculate = (params.logprobs is None and params.prompt_logprobs is None
                              and not params.processes_logits)

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> "Request":
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            arrival_time=request.arrival_time,
            eos_token_ids=request.eos_token_ids,
            priority=request.priority,
            cache_salt=request.cache_salt,
            kv_transfer_params=request.kv_transfer_params,
        )

    @property
    def packed_prompt_token_ids(self) -> bytes:
        """The prompt as the worker takes it (pack_token_ids), packed once."""
        if self._packed_prompt_token_ids is None:
            self._packed_prompt_token_ids = pack_token_ids(self.prompt_token_ids)
        return self._packed_prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end], without copying the rest."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:end] + self.output_token_ids[max(start - num_prompt, 0) : end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The protocol's FINISH_* string once finished, else None."""
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_computed_tokens={self.num_computed_tokens}, num_tokens={self.num_tokens})"
        )
