"""The OpenAI API's request and response bodies (pydantic), with vLLM's extra sampling fields.

Requests ignore fields they do not know (as OpenAI's clients may send new ones); fields we know
but cannot honour are refused with a 400 by the serving code, never silently dropped.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, Field

from minivllm.frontend.server.errors import bad_request
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's extension: a usage object in every chunk, not only in the last one.
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """What completions and chat requests share: vLLM's sampling fields under their names."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None  # None: 1.0 (OpenAI's default)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None
    best_of: int | None = None
    cache_salt: str | None = None
    # vLLM's field for disaggregated prefill: handed to the engine's KV connector (as
    # SamplingParams.extra_args["kv_transfer_params"]); a prefill instance's answer carries the
    # params its decode instance needs.
    kv_transfer_params: dict[str, Any] | None = None

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None = None) -> SamplingParams:
        """The SamplingParams for this request; a ValueError (-> 400) says what is out of range."""
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of ({self.best_of}) other than n ({self.n}) is not supported; "
                              "leave best_of out.", "best_of")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true.", "stream_options")
        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(token): max(-100.0, min(100.0, float(bias)))
                              for token, bias in self.logit_bias.items()}
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids (integers as strings), got "
                                  f"{sorted(self.logit_bias)}.", "logit_bias") from None
        fields: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logit_bias=logit_bias,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA,
        )
        if self.kv_transfer_params is not None:
            fields["extra_args"] = {"kv_transfer_params": self.kv_transfer_params}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        return SamplingParams(**fields)  # raises ValueError (-> 400) with the allowed range


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TextContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    chat_template: str | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
