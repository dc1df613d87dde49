"""Turn a user's prompt into a validated EngineCoreRequest (token ids only) — or a ValueError.

Every check happens here, in the user's process, so a bad request never reaches the engine and
the engine keeps serving everyone else.
"""

from __future__ import annotations

import time
from typing import Any, Union

import msgspec

from minivllm.protocol.messages import EngineCoreRequest, EngineInfo
from minivllm.protocol.sampling_params import SamplingParams

# vLLM's prompt forms: a string, {"prompt": str}, or {"prompt_token_ids": [int, ...]}; a dict may
# also carry "cache_salt": only requests with the same salt share prefix-cache blocks.
PromptType = Union[str, dict[str, Any]]


class InputProcessor:
    def __init__(self, engine_info: EngineInfo, tokenizer: Any | None) -> None:
        self.info = engine_info
        self.tokenizer = tokenizer

    @classmethod
    def for_engine(cls, engine_info: EngineInfo, skip_tokenizer_init: bool) -> "InputProcessor":
        """With the engine's tokenizer loaded through transformers (none if skip_tokenizer_init)."""
        tokenizer = None
        if not skip_tokenizer_init:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(engine_info.tokenizer)
        return cls(engine_info, tokenizer)

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> tuple[EngineCoreRequest, str | None]:
        """Returns the request and the prompt's text (None when given as token ids)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}.")
        if priority != 0 and self.info.scheduling_policy != "priority":
            raise ValueError(f"got priority {priority}, but the engine schedules with policy "
                             f"{self.info.scheduling_policy!r}; start it with scheduling_policy='priority'.")
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty str, got {cache_salt!r}.")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the tokenizer (this engine was made with skip_tokenizer_init=True); "
                             "use stop_token_ids.")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need the tokenizer (this engine was made with skip_tokenizer_init=True).")
        prompt_text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, params)
        if params.bad_words:  # the engine sees token ids only; the user's params stay as given
            params = msgspec.structs.replace(params, _bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=time.time(),
            eos_token_ids=list(self.info.eos_token_ids),
            priority=priority,
            cache_salt=cache_salt,
        )
        return request, prompt_text

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                if not isinstance(token_ids, (list, tuple)) or not all(isinstance(t, int) for t in token_ids):
                    raise ValueError("prompt_token_ids must be a list of ints.")
                return prompt.get("prompt"), list(token_ids)
            if "prompt" not in prompt:
                raise ValueError("a dict prompt needs a 'prompt' (text) or 'prompt_token_ids' key.")
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("this LLM was made with skip_tokenizer_init=True: give prompts as "
                             "{'prompt_token_ids': [...]}.")
        if not prompt:
            raise ValueError("the prompt is empty; give at least one character.")
        return prompt, list(self.tokenizer(prompt).input_ids)

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each word's token ids as it would appear at the start of the text and, when that
        tokenizes differently, after a space (mid-text), as vLLM does."""
        sequences: list[list[int]] = []
        for word in bad_words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(bare)
            # Only when the space makes a new first token (not a separate space token in front).
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        bad = next((t for seq in sequences for t in seq if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:
            raise ValueError(f"bad_words tokenize to id {bad}, outside the model's vocabulary "
                             f"[0, {self.info.vocab_size}).")
        return sequences

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        info = self.info
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token.")
        if len(token_ids) > info.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len="
                             f"{info.max_model_len}; shorten it to at most {info.max_model_len} tokens.")
        for name, ids in (("prompt token", token_ids), ("stop_token_ids entry", params.stop_token_ids),
                          ("logit_bias key", list(params.logit_bias or ())),
                          ("allowed_token_ids entry", params.allowed_token_ids or [])):
            bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name} {bad} is outside the vocabulary; ids must be in [0, {info.vocab_size}).")
        # A request that may outgrow the whole KV cache could never finish: reject it now.
        capacity = info.num_gpu_blocks * info.block_size
        max_num_tokens = info.max_model_len
        if params.max_tokens is not None:
            max_num_tokens = min(len(token_ids) + params.max_tokens, info.max_model_len)
        if max_num_tokens > capacity:
            raise ValueError(
                f"this request may grow to {max_num_tokens} tokens (prompt {len(token_ids)} + max_tokens "
                f"{params.max_tokens}, capped at max_model_len={info.max_model_len}), more than the whole KV "
                f"cache holds ({info.num_gpu_blocks} blocks x {info.block_size} = {capacity} tokens); lower "
                f"max_tokens or shorten the prompt, or give the engine more KV cache."
            )
