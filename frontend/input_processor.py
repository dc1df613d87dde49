"""Turn a user's prompt into a validated EngineCoreRequest (token ids only) — or a ValueError.

The checks run here, in the user's process, so a bad request never reaches the engine. They are
protocol/validation.py's validate_request: the engine runs the very same function on what
arrives at its socket (which need not come from a frontend).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Union

import msgspec

from minivllm.protocol.messages import EngineCoreRequest, EngineInfo
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.validation import EngineLimits, validate_request

# vLLM's prompt forms: a string, {"prompt": str}, or {"prompt_token_ids": [int, ...]}; a dict may
# also carry "cache_salt": only requests with the same salt share prefix-cache blocks.
PromptType = Union[str, dict[str, Any]]


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class TokenizerLoad:
    """load_tokenizer(path) in a thread of its own, started while the frontend waits for the engine
    to start. The load (0.3-0.5 s on a 2-core box) then runs on a core the engine's start leaves
    free, where there is one, instead of after it (benchmarks/RESULTS.md, 2026-11-27: the wait after
    the engine serves went to none; end to end on 2 and 16 cores the gain was within the noise).
    result() waits for it and raises what the load raised."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._future: Future = Future()
        threading.Thread(target=self._load, name="tokenizer-load").start()

    def _load(self) -> None:
        try:
            self._future.set_result(load_tokenizer(self.path))
        except BaseException as error:  # (handed to result()'s caller)
            self._future.set_exception(error)

    def result(self) -> Any:
        return self._future.result()


class InputProcessor:
    def __init__(self, engine_info: EngineInfo, tokenizer: Any | None) -> None:
        self.info = engine_info
        self.limits = EngineLimits.from_engine_info(engine_info)
        self.tokenizer = tokenizer

    @classmethod
    def for_engine(cls, engine_info: EngineInfo, skip_tokenizer_init: bool,
                   loading: "TokenizerLoad | None" = None) -> "InputProcessor":
        """With the engine's tokenizer loaded through transformers (none if skip_tokenizer_init);
        `loading`: that tokenizer's load, started while the engine started."""
        tokenizer = None
        if not skip_tokenizer_init:
            if loading is not None and loading.path == engine_info.tokenizer:
                tokenizer = loading.result()
            else:
                tokenizer = load_tokenizer(engine_info.tokenizer)
        return cls(engine_info, tokenizer)

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> tuple[EngineCoreRequest, str | None]:
        """Returns the request and the prompt's text (None when given as token ids)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the tokenizer (this engine was made with skip_tokenizer_init=True); "
                             "use stop_token_ids.")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need the tokenizer (this engine was made with skip_tokenizer_init=True).")
        kv_transfer_params = self._kv_transfer_params(params)
        if kv_transfer_params is not None:  # it travels on the request, not twice
            rest = {k: v for k, v in params.extra_args.items() if k != "kv_transfer_params"}
            params = msgspec.structs.replace(params, extra_args=rest or None)
        prompt_text, token_ids = self._tokenize(prompt)
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
            kv_transfer_params=kv_transfer_params,
        )
        validate_request(request, self.limits)
        return request, prompt_text

    @staticmethod
    def _kv_transfer_params(params: SamplingParams) -> dict[str, Any] | None:
        """vLLM's way in for a KV connector's per-request settings: extra_args["kv_transfer_params"]."""
        if not params.extra_args or params.extra_args.get("kv_transfer_params") is None:
            return None
        kv_transfer_params = params.extra_args["kv_transfer_params"]
        if not isinstance(kv_transfer_params, dict):
            raise ValueError(f"kv_transfer_params must be a JSON object (dict), got {type(kv_transfer_params).__name__}.")
        if params.n != 1:
            # One prompt's KV goes to (or comes from) one request; n > 1 would fan it out to several.
            raise ValueError(f"kv_transfer_params needs n=1, got n={params.n}.")
        return dict(kv_transfer_params)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                if not isinstance(token_ids, (list, tuple)):
                    raise ValueError("prompt_token_ids must be a list of ints.")
                try:  # a copy, checked in one C pass (a Python loop took 0.36 ms for 16k ids)
                    return prompt.get("prompt"), msgspec.convert(token_ids, list[int])
                except msgspec.ValidationError:  # bools pass as ints, as isinstance says
                    if not all(isinstance(t, int) for t in token_ids):
                        raise ValueError("prompt_token_ids must be a list of ints.") from None
                    return prompt.get("prompt"), [int(t) for t in token_ids]
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
        return sequences
