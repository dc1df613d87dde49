"""Chat conversations -> prompts, through the tokenizer's chat template (as vLLM's LLM.chat)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Conversation = Sequence[dict[str, Any]]  # [{"role": "user", "content": "..."}, ...]


def has_chat_template(tokenizer: Any | None) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def as_conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation (a list of message dicts) or a list of them -> a list of conversations."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts "
                         "(one conversation) or a list of such lists.")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError(f"conversation {i} must be a non-empty list of message dicts.")
        for message in conversation:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"conversation {i}: every message must be a dict with 'role' and "
                                 f"'content', got {message!r}.")
    return conversations


def render_chat_prompt(
    tokenizer: Any,
    conversation: Conversation,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The prompt (text and token ids) for one conversation. chat_template_kwargs: extra
    variables for the template (e.g. {"enable_thinking": False}).

    The rendered text already holds the model's special tokens (e.g. `<|im_start|>`), so it is
    encoded without adding special tokens again: a second BOS would change the model's output.
    """
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this LLM was made with skip_tokenizer_init=True.")
    if chat_template is None and not has_chat_template(tokenizer):
        raise ValueError("the tokenizer has no chat template; pass chat_template=... or use generate() "
                         "with a plain prompt.")
    text = tokenizer.apply_chat_template(
        list(conversation), chat_template=chat_template, add_generation_prompt=add_generation_prompt,
        tokenize=False, **(chat_template_kwargs or {}),
    )
    return {"prompt": text, "prompt_token_ids": list(tokenizer(text, add_special_tokens=False).input_ids)}
