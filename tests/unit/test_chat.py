"""Chat rendering: conversations in, prompts (text + ids) out, special tokens not doubled."""

from __future__ import annotations

import pytest

from minivllm.frontend.chat import as_conversations, has_chat_template, render_chat_prompt
from tests.tiny_models import EOS_TOKEN, EOS_TOKEN_ID, TINY_CHAT_TEMPLATE, build_tiny_tokenizer

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def test_prompt_is_the_rendered_template(tokenizer) -> None:
    prompt = render_chat_prompt(tokenizer, HELLO)
    assert prompt["prompt"] == f"{EOS_TOKEN}user: Hello\nassistant:"
    assert prompt["prompt_token_ids"] == tokenizer(prompt["prompt"], add_special_tokens=False).input_ids
    without = render_chat_prompt(tokenizer, HELLO, add_generation_prompt=False)
    assert without["prompt"] == f"{EOS_TOKEN}user: Hello\n"
    assert render_chat_prompt(tokenizer, HELLO, chat_template="{{ messages[0]['content'] }}")["prompt"] == "Hello"


def test_special_tokens_are_not_added_twice(tokenizer) -> None:
    """A tokenizer that prepends BOS itself (as Llama's do) must not add a second one in front
    of the template's own: that changes the model's answers."""
    from tokenizers.processors import TemplateProcessing

    adds_bos = build_tiny_tokenizer()
    adds_bos.chat_template = TINY_CHAT_TEMPLATE
    adds_bos.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{EOS_TOKEN} $A", special_tokens=[(EOS_TOKEN, EOS_TOKEN_ID)]
    )
    assert adds_bos("Hi").input_ids[0] == EOS_TOKEN_ID  # it really adds one
    ids = render_chat_prompt(adds_bos, HELLO)["prompt_token_ids"]
    assert ids[0] == EOS_TOKEN_ID and ids[1] != EOS_TOKEN_ID


def test_one_or_many_conversations() -> None:
    assert as_conversations(HELLO) == [HELLO]
    assert as_conversations([HELLO, HELLO]) == [HELLO, HELLO]


@pytest.mark.parametrize("messages", [[], "Hello", [[]], [{"role": "user"}], [HELLO, "x"]])
def test_bad_messages_are_value_errors(messages) -> None:
    with pytest.raises(ValueError):
        as_conversations(messages)


def test_no_chat_template(tokenizer) -> None:
    plain = build_tiny_tokenizer()
    assert not has_chat_template(plain) and has_chat_template(tokenizer) and not has_chat_template(None)
    with pytest.raises(ValueError, match="no chat template"):
        render_chat_prompt(plain, HELLO)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        render_chat_prompt(None, HELLO)
