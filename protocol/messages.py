"""Every message that crosses a socket, as msgspec Structs (msgpack on the wire, never pickle).

Two conversations:
  frontend <-> EngineCore : EngineCoreRequest / AddRequests / AbortRequests / UtilityCall / Shutdown in,
                            EngineCoreOutputs out.
  EngineCore <-> workers  : SchedulerOutput / WorkerCall / Shutdown in,
                            ModelRunnerOutput / WorkerReply out.
Messages of one direction form a tagged union, so one Decoder reads them all.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from minivllm.protocol.config import DEFAULT_MAX_PENDING_REQUESTS, EngineConfig
from minivllm.protocol.kv_transfer import KVConnectorMetadata, KVConnectorOutput
from minivllm.protocol.sampling_params import SamplingParams

# ---------------------------------------------------------------- frontend -> EngineCore


class EngineCoreRequest(msgspec.Struct, tag="add", kw_only=True):
    """A tokenized, validated request. The engine sees token ids only."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    # The model's end-of-sequence ids; the scheduler stops on them unless ignore_eos.
    eos_token_ids: list[int] = []
    # scheduling_policy="priority": lower runs first, ties by arrival_time.
    priority: int = 0
    # Mixed into the prefix-cache hash of the first block: only requests with the same salt
    # share cached KV (so one tenant cannot probe another's prompts by timing).
    cache_salt: str | None = None
    # KV transfer (vLLM's kv_transfer_params): what the configured KV connector needs to know about
    # this request, e.g. {"do_remote_decode": true} on a prefill instance, or where to pull the
    # prompt's KV from on a decode instance. Untrusted input: the connector validates it.
    kv_transfer_params: dict[str, Any] | None = None


class AddRequests(msgspec.Struct, tag="add_many"):
    """Requests sent together (LLM.generate's batch), so that the batch's steps do not depend on
    timing (sent one by one, the first would start alone while the rest are on their way). Each is
    checked, admitted or refused on its own, as if it came alone. The engine may start the first
    step on a batch's first requests while it reads the rest, but its scheduler waits for more
    wherever the whole batch would have given it more (EngineCoreProc._BatchPart)."""

    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    """Call EngineCore.<method>(*args); the answer comes back as a UtilityResult."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop the process that receives it (the EngineCore, or a worker)."""


EngineCoreInput = EngineCoreRequest | AddRequests | AbortRequests | UtilityCall | Shutdown

# ---------------------------------------------------------------- EngineCore -> frontend

FINISH_STOP = "stop"  # EOS or a stop token
FINISH_LENGTH = "length"  # max_tokens or the model's maximum length
FINISH_ABORT = "abort"

# Why the engine refused a request (EngineCoreOutput.error_type); it then finishes as "abort".
ERROR_INVALID = "invalid"  # its values failed validation (protocol/validation.py): ValueError
ERROR_OVERLOADED = "overloaded"  # the engine holds max_pending_requests already: EngineOverloadedError
ERROR_KV_TRANSFER = "kv_transfer"  # its KV never arrived (the KV connector's load failed or timed out)


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities (of the model's raw distribution) around one sampled token."""

    token_ids: list[int]  # the sampled token first, then the top-`logprobs` tokens, likeliest first
    logprobs: list[float]
    sampled_rank: int  # 1 = the likeliest token


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities of a prompt's tokens 1..P-1 (token 0 has no context), each under the
    model's distribution given the tokens before it; row i is about prompt token i + 1."""

    token_ids: list[list[int]]  # per row: the prompt token first, then the top-k, likeliest first
    logprobs: list[list[float]]
    ranks: list[int]  # the prompt token's rank (1 = the likeliest)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # FINISH_* once the request is done
    stop_reason: int | None = None  # the stop token id that ended it, if one did
    # Prompt tokens whose KV came from the prefix cache when the request was first scheduled.
    num_cached_tokens: int = 0
    new_logprobs: TokenLogprobs | None = None  # when the request asked for logprobs
    # Once, with the first token, when the request asked for prompt_logprobs.
    prompt_logprobs: PromptLogprobs | None = None
    # Set (with finish_reason "abort") when the engine refused the request: ERROR_* and its message.
    error_type: str | None = None
    error: str | None = None
    # With the last output, when the request's KV can be pulled by another instance (a prefill
    # instance's answer): the kv_transfer_params a decode instance's request carries.
    kv_transfer_params: dict[str, Any] | None = None


class UtilityResult(msgspec.Struct, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    utility_result: UtilityResult | None = None
    # Set when the engine can no longer serve: the reason, for EngineDeadError.
    engine_dead: str | None = None


class EngineInfo(msgspec.Struct, kw_only=True):
    """What a frontend needs to know about the engine it attached to."""

    model: str
    tokenizer: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    engine_pid: int
    worker_pids: list[int]
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS


class EngineStats(msgspec.Struct, kw_only=True):
    """The `get_stats` utility's answer: the scheduler's gauges now and its counters since start."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float  # fraction of KV blocks held by requests (cached free blocks count as free)
    num_gpu_blocks: int
    num_preemptions: int
    # Prompt tokens looked up in the prefix cache when requests were first scheduled, and how
    # many of them were found there.
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Tokens run through the model without sampling at their end: prompt chunks, and the
    # prompt + outputs a preempted request recomputes. Cached tokens are not computed.
    num_prefill_tokens: int
    num_generation_tokens: int  # tokens sampled
    num_finished_reqs: int
    # Speculative decoding (vLLM's spec_decode counters): requests verified with drafts, draft tokens
    # proposed and accepted, and per draft position how many were accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        n = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / n if n else 0.0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens gained per verify step and request: 1 (the target's own) + accepted drafts."""
        n = self.spec_decode_num_drafts
        return 1.0 + self.spec_decode_num_accepted_tokens / n if n else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


# ---------------------------------------------------------------- EngineCore -> workers

assert array.array("i").itemsize == 4  # (a C int: 4 bytes wherever torch runs)


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes: one msgpack bin on the wire, where a list is an
    array of ints that the receiver turns back into one object per token (a 32k-token prompt: ~0.5
    ms to decode, and as much again to copy into numpy; packed, numpy reads it in place)."""
    packed = array.array("i", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    """pack_token_ids' inverse."""
    unpacked = array.array("i")
    unpacked.frombytes(data)
    if sys.byteorder != "little":
        unpacked.byteswap()
    return unpacked.tolist()


class NewRequestData(msgspec.Struct, kw_only=True):
    """A request the worker has not seen (or lost when it was preempted): sent in full."""

    req_id: str
    # Packed (pack_token_ids; numpy.frombuffer(..., "<i4") reads them). A list given here is packed.
    prompt_token_ids: bytes
    # Tokens generated before a preemption; empty for a fresh request.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # The model's EOS ids, which min_tokens keeps the sampler from picking too early.
    eos_token_ids: list[int] = []

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, bytes):
            self.prompt_token_ids = pack_token_ids(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids) // 4


class CachedRequestData(msgspec.Struct, array_like=True):
    """A request the worker already holds: only what changed since its last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Tail blocks the scheduler took back since the request's last step (they held only rejected
    # draft tokens): drop them from the block table before appending new_block_ids.
    num_released_blocks: int = 0
    # Pipeline parallelism only (else empty): the tokens this step runs, for the stages that do
    # not sample and so do not know the previous step's token (as vLLM's new_token_ids).
    new_token_ids: list[int] = []


class SchedulerOutput(msgspec.Struct, tag="schedule", kw_only=True):
    """One step's work. Each scheduled request runs tokens
    [num_computed_tokens, num_computed_tokens + num_scheduled_tokens[req_id]) of its known tokens;
    it samples a new token only when that range reaches the end of its known tokens.

    With prefix caching a new request's first blocks may be another request's, and its
    num_computed_tokens starts past them. Those blocks may be filled by the other request in
    this very step: the worker must write every scheduled token's K/V in a layer before any
    attention of that layer reads the cache (what paged-attention backends do anyway).
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the worker should forget: finished or aborted since the last step. The worker drops
    # these (and preempted_req_ids) before adding scheduled_new_reqs, since a resumed request can
    # appear in both; ids it never saw (aborted while waiting) are ignored.
    finished_req_ids: list[str]
    # Requests pushed back to waiting; they come back later as NewRequestData.
    preempted_req_ids: list[str] = []
    # Counts the scheduler's steps, so the EngineCore can match a step's tokens to it when several
    # steps are in flight (async scheduling).
    step_id: int = 0
    # Set only when a KV connector is configured (protocol/kv_transfer.py): the step's KV
    # transfer instructions. A step carrying it goes to the workers even with no tokens scheduled.
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Speculative decoding (vLLM's name): per request, the draft tokens scheduled after its last
    # known token (they are part of num_scheduled_tokens); the worker verifies them in this step.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Whether the worker should propose drafts for the requests that sample in this step (they come
    # back in ModelRunnerOutput.spec_token_ids); off while speculation steps aside.
    propose_drafts: bool = False


class WorkerCall(msgspec.Struct, tag="call"):
    """Call Worker.<method>(*args) on every worker; each answers with a WorkerReply."""

    method: str
    args: list[Any] = []


EngineToWorker = SchedulerOutput | WorkerCall | Shutdown


class DeferredStart(msgspec.Struct, frozen=True):
    """A worker started before its engine had a config (core/executor.py's PrestartedWorker) reads
    this from its stdin (JSON) once the engine has one."""

    config: EngineConfig
    dist_init_address: str | None = None  # torch.distributed's rendezvous, with more than one rank

# ---------------------------------------------------------------- workers -> EngineCore


class ModelRunnerOutput(msgspec.Struct, tag="output"):
    """The token sampled for each request whose scheduled tokens reached its end."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    # Parallel to req_ids when any request asked for logprobs (None for those that did not).
    logprobs: list[TokenLogprobs | None] | None = None
    # Parallel to req_ids when a request whose prompt just finished asked for prompt_logprobs. The
    # worker gathers them chunk by chunk and sends them all with the prompt's first sampled token.
    prompt_logprobs: list[PromptLogprobs | None] | None = None
    # With a KV connector: the transfers that completed (rides on whichever output goes out next).
    kv_connector_output: KVConnectorOutput | None = None
    # Speculative decoding, parallel to req_ids: the draft tokens each request accepted this step,
    # which come before its sampled token (so its new tokens are accepted + [sampled]); and the
    # drafts proposed for its next step (when SchedulerOutput.propose_drafts).
    accepted_draft_token_ids: list[list[int]] | None = None
    spec_token_ids: list[list[int]] | None = None


class WorkerReply(msgspec.Struct, tag="reply", omit_defaults=True):
    rank: int
    method: str
    result: Any = None
    error: str | None = None  # a traceback when the call (or a model step) failed


WorkerToEngine = ModelRunnerOutput | WorkerReply
