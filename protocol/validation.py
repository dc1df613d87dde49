"""The one set of request checks, shared by the frontend (InputProcessor, before anything is sent)
and the EngineCore (before a request from its socket reaches the scheduler: the socket is
untrusted, and a request that skipped the frontend must not be able to crash a worker).

Each error says what was wrong and the allowed range. Two layers:
  validate_sampling_params(params)             ranges that need no engine (SamplingParams runs it
                                               at construction, and msgspec runs that on decode)
  validate_request(request, limits)            everything, against one engine's vocabulary,
                                               lengths and KV cache: token ids in range, prompt
                                               length, KV capacity, list sizes, ...
Nothing here imports torch or knows a process.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

if TYPE_CHECKING:
    from minivllm.protocol.messages import EngineCoreRequest, EngineInfo
    from minivllm.protocol.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # most alternatives per token (vLLM's default max_logprobs)
MIN_TEMPERATURE = 1e-5  # below it (but above 0), use 0: greedy (vLLM treats such values as greedy)
MAX_N = 128  # most completions per prompt (OpenAI's limit for n)
# Ints the worker keeps in int64 arrays (top_k, min_tokens, seeds) must fit there; these caps are
# far above any meaningful value.
MAX_TOP_K = 2**31 - 1
MAX_MIN_TOKENS = 2**31 - 1
MAX_MAX_TOKENS = 2**63 - 1
MAX_LOGIT_BIAS = 100.0  # |bias| (as OpenAI's API): beyond it a token is simply forced or banned
MAX_STOP_TOKEN_IDS = 1024
MAX_EOS_TOKEN_IDS = 64
MAX_BAD_WORDS = 256  # tokenized sequences (a word may give two)
MAX_BAD_WORD_TOKENS = 64
MAX_REQUEST_ID_LENGTH = 1024
# On the wire the frontend adds its client prefix and, for n > 1, a child suffix ("_127").
WIRE_REQUEST_ID_OVERHEAD = 64
MAX_CACHE_SALT_LENGTH = 1024
MAX_PRIORITY = 2**63 - 1


def _check_int(name: str, value: Any, low: int, high: int, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}]{hint}, got {value!r}.")


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    return float(value)


def validate_sampling_params(p: "SamplingParams") -> None:
    """The ranges of every SamplingParams field (no engine needed). Raises ValueError."""
    if p.stop is not None and (not isinstance(p.stop, list) or not all(isinstance(x, str) and x for x in p.stop)):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {p.stop!r}.")
    _check_int("n", p.n, 1, MAX_N)
    temperature = _check_float("temperature", p.temperature)
    if temperature < 0.0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {p.temperature}.")
    if 0.0 < temperature < MIN_TEMPERATURE:  # logits / temperature would overflow to inf, then NaN
        raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {p.temperature}.")
    if not 0.0 < _check_float("top_p", p.top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}.")
    _check_int("top_k", p.top_k, -1, MAX_TOP_K, " (-1 and 0: off)")
    if p.max_tokens is not None and (not isinstance(p.max_tokens, int) or not 1 <= p.max_tokens <= MAX_MAX_TOKENS):
        raise ValueError(f"max_tokens must be >= 1 (and < 2**63), or None; got {p.max_tokens!r}.")
    if p.seed is not None and (not isinstance(p.seed, int) or not 0 <= p.seed < 2**63):
        raise ValueError(f"seed must be in [0, 2**63) or None, got {p.seed!r}.")
    if not isinstance(p.stop_token_ids, list) or len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids.")
    if any(not isinstance(t, int) or t < 0 for t in p.stop_token_ids):
        raise ValueError(f"stop_token_ids must be non-negative, got {p.stop_token_ids}.")
    if not 0.0 <= _check_float("min_p", p.min_p) <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p}.")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= _check_float(name, getattr(p, name)) <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(p, name)}.")
    if not _check_float("repetition_penalty", p.repetition_penalty) > 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {p.repetition_penalty}.")
    _check_int("min_tokens", p.min_tokens, 0, MAX_MIN_TOKENS)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ValueError(f"min_tokens ({p.min_tokens}) must be <= max_tokens ({p.max_tokens}).")
    if p.logit_bias is not None:
        if any(not isinstance(t, int) or t < 0 for t in p.logit_bias):
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {sorted(p.logit_bias)[:10]}.")
        for token_id, bias in p.logit_bias.items():
            if not -MAX_LOGIT_BIAS <= _check_float(f"logit_bias[{token_id}]", bias) <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {bias} for token {token_id}.")
    if p.logprobs is not None:
        _check_int("logprobs", p.logprobs, 0, MAX_LOGPROBS, " (or None)")
    if p.prompt_logprobs is not None:
        _check_int("prompt_logprobs", p.prompt_logprobs, 0, MAX_LOGPROBS, " (or None)")
    if p.bad_words is not None and (not isinstance(p.bad_words, list)
                                    or not all(isinstance(w, str) and w.strip() for w in p.bad_words)):
        raise ValueError(f"bad_words must be a list of non-blank strings, got {p.bad_words!r}.")
    if not p.detokenize and p.stop:
        raise ValueError("stop strings need detokenize=True (without text there is nothing to match); "
                         "use stop_token_ids.")
    if p.allowed_token_ids is not None and (
        not p.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in p.allowed_token_ids)
    ):
        raise ValueError("allowed_token_ids must be a non-empty list of non-negative token ids.")
    words = p._bad_words_token_ids
    if words is not None:
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words give {len(words)} token sequences; at most {MAX_BAD_WORDS} are allowed.")
        if any(not 1 <= len(word) <= MAX_BAD_WORD_TOKENS for word in words):
            raise ValueError(f"each bad word must be 1 to {MAX_BAD_WORD_TOKENS} tokens long.")


@dataclass(frozen=True)
class EngineLimits:
    """What a request is checked against: one engine's model and KV cache."""

    vocab_size: int
    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    scheduling_policy: str = "fcfs"

    @property
    def max_message_bytes(self) -> int:
        """The largest message the engine takes (ZMQ drops a peer that sends more): what one valid
        request can need (a prompt of max_model_len tokens, a logit_bias over the whole vocabulary,
        ...) with room to spare. A frontend keeps its AddRequests batches below it."""
        return (1 << 20) + 9 * self.max_model_len + 40 * self.vocab_size

    @classmethod
    def from_engine_info(cls, info: "EngineInfo") -> "EngineLimits":
        return cls(vocab_size=info.vocab_size, max_model_len=info.max_model_len, num_gpu_blocks=info.num_gpu_blocks,
                   block_size=info.block_size, scheduling_policy=info.scheduling_policy)


@functools.lru_cache(maxsize=8)
def _token_ids_type(vocab_size: int) -> Any:
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def _check_token_ids(name: str, ids: Any, vocab_size: int) -> None:
    """Every id an int in [0, vocab_size). msgspec checks a list of them in one C pass (a 16k-token
    prompt: 0.05 ms, against 0.3 for min and max); what it refuses (bools among them, which pass
    as ints) goes the slow way, which also names the id that is out of range."""
    if not ids:
        return
    try:
        msgspec.convert(ids, _token_ids_type(vocab_size))
        return
    except msgspec.ValidationError:
        pass
    try:
        low, high = min(ids), max(ids)
    except TypeError:
        raise ValueError(f"{name}s must be integers.") from None
    if not isinstance(low, int) or not isinstance(high, int):
        raise ValueError(f"{name}s must be integers.")
    bad = low if low < 0 else high if high >= vocab_size else None
    if bad is not None:
        raise ValueError(f"{name} {bad} is outside the vocabulary; ids must be in [0, {vocab_size}).")


def validate_request(request: "EngineCoreRequest", limits: EngineLimits, wire: bool = False) -> None:
    """Everything about one tokenized request, against the engine it goes to. Raises ValueError.

    wire=True: the request came off the engine's socket (its id carries the frontend's prefix).
    """
    max_id_length = MAX_REQUEST_ID_LENGTH + (WIRE_REQUEST_ID_OVERHEAD if wire else 0)
    if not isinstance(request.request_id, str) or not 0 < len(request.request_id) <= max_id_length:
        raise ValueError(f"request_id must be a string of 1 to {max_id_length} characters.")
    params = request.sampling_params
    # Values decoded off the wire passed these at decode time, but a frontend's params may have
    # been changed after construction: check them again here, once per request.
    validate_sampling_params(params)
    token_ids = request.prompt_token_ids
    if not token_ids:
        raise ValueError("the prompt is empty; give at least one token.")
    if len(token_ids) > limits.max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len="
                         f"{limits.max_model_len}; shorten it to at most {limits.max_model_len} tokens.")
    vocab = limits.vocab_size
    _check_token_ids("prompt token", token_ids, vocab)
    _check_token_ids("stop_token_ids entry", params.stop_token_ids, vocab)
    if params.logit_bias:
        if len(params.logit_bias) > vocab:
            raise ValueError(f"logit_bias has {len(params.logit_bias)} entries; at most {vocab} (the vocabulary).")
        _check_token_ids("logit_bias key", list(params.logit_bias), vocab)
    if params.allowed_token_ids:
        if len(params.allowed_token_ids) > vocab:
            raise ValueError(f"allowed_token_ids has {len(params.allowed_token_ids)} entries; at most {vocab} "
                             "(the vocabulary).")
        _check_token_ids("allowed_token_ids entry", params.allowed_token_ids, vocab)
    for word in params._bad_words_token_ids or ():
        _check_token_ids("bad_words token", word, vocab)
    if len(request.eos_token_ids) > MAX_EOS_TOKEN_IDS:
        raise ValueError(f"eos_token_ids has {len(request.eos_token_ids)} entries; at most {MAX_EOS_TOKEN_IDS}.")
    _check_token_ids("eos_token_ids entry", request.eos_token_ids, vocab)
    for name, k in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if k is not None and k > vocab:
            raise ValueError(f"{name} must be in [0, {min(MAX_LOGPROBS, vocab)}] for this model, got {k}.")
    priority = request.priority
    _check_int("priority", priority, -MAX_PRIORITY, MAX_PRIORITY)
    if priority != 0 and limits.scheduling_policy != "priority":
        raise ValueError(f"got priority {priority}, but the engine schedules with policy "
                         f"{limits.scheduling_policy!r}; start it with scheduling_policy='priority'.")
    _check_float("arrival_time", request.arrival_time)
    salt = request.cache_salt
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_LENGTH):
        raise ValueError(f"cache_salt must be a non-empty str of at most {MAX_CACHE_SALT_LENGTH} characters, "
                         f"got {salt!r:.80}.")
    # A request that may outgrow the whole KV cache could never finish: reject it now.
    capacity = limits.num_gpu_blocks * limits.block_size
    max_num_tokens = limits.max_model_len
    if params.max_tokens is not None:
        max_num_tokens = min(len(token_ids) + params.max_tokens, limits.max_model_len)
    if max_num_tokens > capacity:
        raise ValueError(
            f"this request may grow to {max_num_tokens} tokens (prompt {len(token_ids)} + max_tokens "
            f"{params.max_tokens}, capped at max_model_len={limits.max_model_len}), more than the whole KV "
            f"cache holds ({limits.num_gpu_blocks} blocks x {limits.block_size} = {capacity} tokens); lower "
            f"max_tokens or shorten the prompt, or give the engine more KV cache."
        )
