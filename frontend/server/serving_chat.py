"""POST /v1/chat/completions: a conversation rendered through the model's chat template (or the
request's / the server's), OpenAI's chat.completion objects out, whole or streamed."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request

from minivllm.frontend.chat import render_chat_prompt
from minivllm.frontend.server.errors import bad_request
from minivllm.frontend.server.protocol import ChatCompletionRequest, ChatMessage
from minivllm.frontend.server.serving_completions import with_cache_salt
from minivllm.frontend.server.serving_engine import (SSE_DONE, ChoiceState, Items, OpenAIServing, PromptRun,
                                                     decoded, kv_transfer_params_of, random_id, run_request, sse,
                                                     usage)
from minivllm.protocol.sampling_params import MAX_LOGPROBS

# apply_chat_template's own arguments: a request's chat_template_kwargs may not set them.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "chat_template", "add_generation_prompt", "tokenize", "tools",
                             "documents", "return_dict", "continue_final_message"}


def message_text(message: ChatMessage, position: int) -> str:
    """A message's content as one string: list-of-text-parts content joined by newlines."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{position}]: content part of type {part.type!r} is not supported; "
                              "only {'type': 'text', 'text': ...} parts are.", "messages")
        texts.append(part.text)
    return "\n".join(texts)


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise bad_request("messages must not be empty.", "messages")
    conversation = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": message_text(message, i)}
        if message.name is not None:
            entry["name"] = message.name
        conversation.append(entry)
    return conversation


def render(serving: OpenAIServing, messages: list[ChatMessage], chat_template: str | None,
           add_generation_prompt: bool, chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The prompt (text and token ids) of a conversation; a ValueError for a bad one."""
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs or ()))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved}; use the request's own fields.",
                          "chat_template_kwargs")
    try:
        return render_chat_prompt(serving.engine.tokenizer, conversation_of(messages),
                                  chat_template or serving.chat_template, add_generation_prompt,
                                  chat_template_kwargs)
    except ValueError:
        raise
    except Exception as e:  # a template that fails to render (jinja errors, raise_exception(...))
        raise bad_request(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                          "messages") from e


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list, top_n: int) -> list[dict]:
    """OpenAI's chat logprobs content: per token {token, logprob, bytes, top_logprobs}."""
    content = []
    for token_id, position in zip(token_ids, logprobs):
        entry = position.get(token_id) if position is not None else None
        text = decoded(tokenizer, token_id, entry)
        top = sorted(((lp.rank or 0, t, lp) for t, lp in (position or {}).items() if lp.rank and lp.rank <= top_n),
                     key=lambda x: x[0])
        content.append({
            "token": text, "logprob": max(entry.logprob, -9999.0) if entry else -9999.0,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": (s := decoded(tokenizer, t, lp)), "logprob": max(lp.logprob, -9999.0),
                              "bytes": list(s.encode("utf-8"))} for _, t, lp in top],
        })
    return content


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing, response_role: str = "assistant") -> None:
        self.serving = serving
        self.response_role = response_role

    async def create(self, body: ChatCompletionRequest, raw_request: Request):
        serving = self.serving
        serving.check_model(body.model)
        serving.check_engine()
        if body.tools or body.tool_choice not in (None, "none"):
            raise bad_request("tools / tool_choice are not supported by this server.", "tools")
        if body.response_format is not None and body.response_format.get("type", "text") != "text":
            raise bad_request("response_format other than {'type': 'text'} is not supported.", "response_format")
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise bad_request("top_logprobs needs logprobs=true.", "top_logprobs")
            if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}.",
                                  "top_logprobs")
        top_n = body.top_logprobs or 0
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        try:
            params = body.to_sampling_params(max_tokens, top_n if body.logprobs else None)
            prompt = render(serving, body.messages, body.chat_template, body.add_generation_prompt,
                            body.chat_template_kwargs)
        except ValueError as e:
            raise bad_request(str(e)) from e
        prompts = with_cache_salt([prompt], body.cache_salt)
        # echo: an answer that continues the last message starts with it (when it has the answer's role).
        echo_text = ""
        if body.echo and body.messages and body.messages[-1].role == self.response_role:
            echo_text = message_text(body.messages[-1], len(body.messages) - 1)
        request_id, created = random_id("chatcmpl"), int(time.time())
        model, tokenizer, role = serving.model_name, serving.engine.tokenizer, self.response_role
        head = {"id": request_id, "object": "chat.completion", "created": created, "model": model}
        chunk_head = {**head, "object": "chat.completion.chunk"}

        def build_response(runs: list[PromptRun], outputs: list) -> dict:
            choices: dict[int, ChoiceState] = {}
            for _, output in outputs:
                for c in output.outputs:
                    state = choices.setdefault(c.index, ChoiceState(c.index))
                    state.add(c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
            result = []
            for index in sorted(choices):
                state = choices[index]
                result.append({
                    "index": index, "message": {"role": role, "content": echo_text + "".join(state.text)},
                    "logprobs": {"content": chat_logprobs(tokenizer, state.token_ids, state.logprobs, top_n)}
                    if body.logprobs else None,
                    "finish_reason": state.finish_reason, "stop_reason": state.stop_reason})
            num_completion = sum(len(state.token_ids) for state in choices.values())
            return {**head, "choices": result, "usage": usage(len(runs[0].prompt_token_ids), num_completion),
                    "kv_transfer_params": kv_transfer_params_of(runs)}

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        continuous = include_usage and body.stream_options.continuous_usage_stats

        async def stream_chunks(runs: list[PromptRun], items: Items):
            started: set[int] = set()
            num_completion = 0
            num_prompt = 0
            async for _, output in items:
                num_prompt = len(output.prompt_token_ids)
                for c in output.outputs:
                    if c.index not in started:  # every choice's stream opens with the role
                        started.add(c.index)
                        yield sse({**chunk_head, "choices": [{
                            "index": c.index, "delta": {"role": role, "content": echo_text},
                            "logprobs": None, "finish_reason": None}]})
                    num_completion += len(c.token_ids)
                    if not c.text and c.finish_reason is None and not (body.logprobs and c.token_ids):
                        continue
                    chunk = {**chunk_head, "choices": [{
                        "index": c.index, "delta": {"content": c.text} if c.text else {},
                        "logprobs": {"content": chat_logprobs(tokenizer, c.token_ids, c.logprobs or [None] *
                                                              len(c.token_ids), top_n)} if body.logprobs else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                    if continuous:
                        chunk["usage"] = usage(num_prompt, num_completion)
                    yield sse(chunk)
            if include_usage:
                yield sse({**chunk_head, "choices": [], "usage": usage(num_prompt, num_completion)})
            yield SSE_DONE

        return await run_request(serving, raw_request, prompts, params, body.priority, request_id, body.stream,
                                 stream_chunks, build_response)
