"""SamplingParams: how one request picks its tokens and when it stops (vLLM's meaning and defaults)."""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import msgspec

from minivllm.protocol.validation import MAX_LOGPROBS, MIN_TEMPERATURE, validate_sampling_params

__all__ = ["MAX_LOGPROBS", "RequestOutputKind", "SamplingParams"]


class RequestOutputKind(IntEnum):
    """What a streaming consumer (AsyncLLM.generate) receives, as in vLLM."""

    CUMULATIVE = 0  # every output holds all tokens / text so far
    DELTA = 1  # every output holds only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request sampling settings. Invalid values raise ValueError at construction (and decoding).

    temperature 0 means greedy. top_k 0 or -1 means no top-k cut. max_tokens None means
    "until the model's maximum length". seed makes the request's samples reproducible
    whatever else shares its batch.
    """

    n: int = 1  # completions per prompt (LLM.generate fans them out; they share the prompt's KV)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest one
    seed: int | None = None
    # Penalties on tokens already present: presence/frequency on the output (subtracted from the
    # logit once / per occurrence), repetition on prompt + output (logit divided by it if positive,
    # multiplied if negative); 0, 0, 1 are off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0  # EOS and stop tokens cannot end the request before this many tokens
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    # Stop strings: the frontend ends the request when its text contains one (trimmed from the
    # text unless include_stop_str_in_output); a single string is taken as a list of one.
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # sample only among these
    # Return the sampled token's logprob and rank plus this many top alternatives (0: just the
    # sampled token's), per generated token. Of the model's raw distribution, as vLLM V1 reports.
    logprobs: int | None = None
    # Per prompt token (the first has none): its logprob and rank plus this many top alternatives,
    # in RequestOutput.prompt_logprobs. Such a request skips the prefix cache (cached tokens have
    # no logits), as in vLLM.
    prompt_logprobs: int | None = None
    # Words never to generate: the frontend tokenizes each (with and without a leading space) into
    # _bad_words_token_ids; the worker bans a word's last token whenever the output ends with the
    # tokens before it.
    bad_words: list[str] | None = None
    # detokenize=False: token ids only, no text (so no stop strings). The other two shape the text.
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Only the frontend reads it (the engine streams token ids either way); an int on the wire.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Arguments for extensions, as vLLM's extra_args; the engine reads "kv_transfer_params" (a dict for
    # the configured KV connector: see EngineCoreRequest.kv_transfer_params) and ignores the rest.
    extra_args: dict[str, Any] | None = None
    # Set by the frontend from bad_words (the engine knows no strings); not for users.
    _bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        try:  # also takes the plain ints 0 / 1 / 2
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY), "
                             f"got {self.output_kind!r}.") from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        # As vLLM: a temperature too small to divide logits by safely means greedy.
        if isinstance(self.temperature, (int, float)) and 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}.")
        # The ranges live in protocol/validation.py, shared with the engine's checks of its socket.
        validate_sampling_params(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether the worker must change this request's logits before sampling."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0 or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self._bad_words_token_ids))
