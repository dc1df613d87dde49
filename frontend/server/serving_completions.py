"""POST /v1/completions: prompts (text, token ids, or lists of either) in, OpenAI's text_completion
objects out, whole or streamed."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request

from minivllm.frontend.input_processor import PromptType
from minivllm.frontend.server.errors import bad_request
from minivllm.frontend.server.protocol import CompletionRequest
from minivllm.frontend.server.serving_engine import (SSE_DONE, ChoiceState, Items, OpenAIServing, PromptRun,
                                                     decoded, kv_transfer_params_of, random_id, run_request, sse,
                                                     usage)


def prompts_of(prompt: Any) -> list[PromptType]:
    """OpenAI's four prompt forms -> the engine's prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty: give a string, a list of strings, a list of token ids or "
                          "a list of token-id lists.", "prompt")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": list(prompt)}]
    if isinstance(prompt[0], str):
        return list(prompt)
    for ids in prompt:
        if not ids:
            raise bad_request("a token-id prompt must not be empty.", "prompt")
    return [{"prompt_token_ids": list(ids)} for ids in prompt]


def with_cache_salt(prompts: list[PromptType], cache_salt: str | None) -> list[PromptType]:
    if cache_salt is None:
        return prompts
    return [{"prompt": p, "cache_salt": cache_salt} if isinstance(p, str) else {**p, "cache_salt": cache_salt}
            for p in prompts]


class CompletionLogprobs:
    """OpenAI's completions logprobs (tokens, token_logprobs, top_logprobs, text_offset) for one
    choice, built piece by piece; text_offset counts characters from the choice's text start."""

    def __init__(self, tokenizer: Any, offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.offset = offset

    def piece(self, token_ids: list[int], logprobs: list, prompt: bool = False) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, position in zip(token_ids, logprobs):
            entry = position.get(token_id) if position is not None else None
            text = decoded(self.tokenizer, token_id, entry)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if entry is None else entry.logprob)
            out["top_logprobs"].append(None if position is None else {
                decoded(self.tokenizer, t, lp): lp.logprob for t, lp in position.items()})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def merge_logprobs(pieces: list[dict]) -> dict:
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for piece in pieces:
        for key in merged:
            merged[key].extend(piece[key])
    return merged


class OpenAIServingCompletion:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: CompletionRequest, raw_request: Request):
        serving = self.serving
        serving.check_model(body.model)
        serving.check_engine()
        if body.suffix:
            raise bad_request("suffix is not supported.", "suffix")
        prompts = with_cache_salt(prompts_of(body.prompt), body.cache_salt)
        if body.kv_transfer_params is not None and len(prompts) > 1:
            raise bad_request(f"kv_transfer_params goes with one prompt; got {len(prompts)} prompts.",
                              "kv_transfer_params")
        echo_logprobs = body.echo and body.logprobs is not None
        try:
            params = body.to_sampling_params(body.max_tokens, body.logprobs,
                                             prompt_logprobs=body.logprobs if echo_logprobs else None)
        except ValueError as e:
            raise bad_request(str(e)) from e
        request_id, created = random_id("cmpl"), int(time.time())
        n, model, tokenizer = params.n, serving.model_name, serving.engine.tokenizer
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model}

        def prompt_text(run: PromptRun) -> str:
            if run.prompt_text is not None:
                return run.prompt_text
            return tokenizer.decode(run.prompt_token_ids) if tokenizer is not None else ""

        def echo_piece(run: PromptRun, lp: CompletionLogprobs | None) -> tuple[str, dict | None]:
            text = prompt_text(run)
            if lp is None:
                return text, None
            piece = lp.piece(run.prompt_token_ids, run.prompt_logprobs or [None] * len(run.prompt_token_ids))
            lp.offset = len(text)  # the output's offsets count from the end of the echoed text
            return text, piece

        def build_response(runs: list[PromptRun], outputs: list) -> dict:
            choices: dict[int, ChoiceState] = {}
            for i, output in outputs:
                for c in output.outputs:
                    state = choices.setdefault(i * n + c.index, ChoiceState(i * n + c.index))
                    state.add(c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
            result = []
            for index in sorted(choices):
                state, run = choices[index], runs[index // n]
                lp = CompletionLogprobs(tokenizer) if body.logprobs is not None else None
                text, pieces = "", []
                if body.echo:
                    text, piece = echo_piece(run, lp)
                    pieces.append(piece)
                if lp is not None:
                    pieces.append(lp.piece(state.token_ids, state.logprobs))
                result.append({"index": index, "text": text + "".join(state.text),
                               "logprobs": merge_logprobs([p for p in pieces if p]) if lp is not None else None,
                               "finish_reason": state.finish_reason, "stop_reason": state.stop_reason})
            num_prompt = sum(len(run.prompt_token_ids) for run in runs)
            num_completion = sum(len(state.token_ids) for state in choices.values())
            return {**head, "choices": result, "usage": usage(num_prompt, num_completion),
                    "kv_transfer_params": kv_transfer_params_of(runs)}

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        continuous = include_usage and body.stream_options.continuous_usage_stats

        async def stream_chunks(runs: list[PromptRun], items: Items):
            choices: dict[int, tuple[ChoiceState, CompletionLogprobs | None]] = {}
            num_completion = 0
            async for i, output in items:
                for c in output.outputs:
                    index = i * n + c.index
                    if index not in choices:
                        choices[index] = (ChoiceState(index),
                                          CompletionLogprobs(tokenizer) if body.logprobs is not None else None)
                    state, lp = choices[index]
                    text, pieces = c.text, []
                    if body.echo and not state.started:
                        echoed, piece = echo_piece(runs[i], lp)
                        text = echoed + text
                        pieces.append(piece)
                    state.started = True
                    if lp is not None and c.token_ids:
                        pieces.append(lp.piece(c.token_ids, c.logprobs or [None] * len(c.token_ids)))
                    num_completion += len(c.token_ids)
                    if not text and not c.token_ids and c.finish_reason is None:
                        continue
                    chunk = {**head, "choices": [{
                        "index": index, "text": text,
                        "logprobs": merge_logprobs([p for p in pieces if p]) if lp is not None else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                    if continuous:
                        chunk["usage"] = usage(sum(len(r.prompt_token_ids) for r in runs), num_completion)
                    yield sse(chunk)
            if include_usage:
                num_prompt = sum(len(run.prompt_token_ids) for run in runs)
                yield sse({**head, "choices": [], "usage": usage(num_prompt, num_completion)})
            yield SSE_DONE

        return await run_request(serving, raw_request, prompts, params, body.priority, request_id, body.stream,
                                 stream_chunks, build_response)
