"""What generate() returns: RequestOutput holding one CompletionOutput per completion (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """One token's log-probability (of the model's raw distribution) and its rank (1 = likeliest)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: token id -> Logprob, holding the sampled token and the top-k alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: None for the first (nothing before it), then as for SampleLogprobs.
PromptLogprobsList = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, when asked
    logprobs: SampleLogprobs | None = None  # when SamplingParams.logprobs is set
    finish_reason: str | None = None  # "stop" | "length" | "abort", None while running
    stop_reason: int | str | None = None  # the stop token id (or string) that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to a request, in time.time() seconds, as the frontend saw them."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # When each output token reached the frontend (tokens of one step share a time).
    token_times: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: PromptLogprobsList | None = None  # when SamplingParams.prompt_logprobs is set
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # From the KV connector, with the finished output (vLLM's name): on a prefill instance, what a
    # decode instance's request needs to pull this request's KV (see EngineCoreOutput).
    kv_transfer_params: dict[str, Any] | None = None
