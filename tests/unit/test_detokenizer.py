"""The frontend's incremental detokenizer: streamed text never shows half a UTF-8 character, and
skip_special_tokens / spaces_between_special_tokens shape the text as in vLLM."""

from __future__ import annotations

import pytest

from minivllm.frontend.output_processor import RequestState
from minivllm.protocol.messages import EngineCoreOutput
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams
from tests.tiny_models import build_tiny_tokenizer

# 2-, 3- and 4-byte characters next to ASCII.
TEXT = "Héllo wörld: 日本語 ok 🙂🎉 ça va — fin"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def stream(state: RequestState, token_ids: list[int], kind: RequestOutputKind, per_step: int = 1,
           finish_reason: str = "length") -> list[str]:
    """Feed the tokens as the engine would (per_step at a time); the streamed texts."""
    texts = []
    for start in range(0, len(token_ids), per_step):
        last = start + per_step >= len(token_ids)
        state.update(EngineCoreOutput(request_id="r", new_token_ids=token_ids[start:start + per_step],
                                      finish_reason=finish_reason if last else None))
        texts.append(state.to_stream_output(kind).outputs[0].text)
    return texts


@pytest.mark.parametrize("per_step", [1, 2, 3])
def test_streamed_deltas_never_split_a_character(tokenizer, per_step: int) -> None:
    prompt = tokenizer("Say:").input_ids
    token_ids = tokenizer(TEXT).input_ids
    # The byte-level BPE saw no such characters in training: each is split into single-byte tokens.
    for char in "é日🙂":
        assert len(tokenizer(char).input_ids) == len(char.encode())
    state = RequestState("r", "Say:", prompt, tokenizer, params=SamplingParams(output_kind=RequestOutputKind.DELTA))
    deltas = stream(state, token_ids, RequestOutputKind.DELTA, per_step)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == state.completion.text
    assert sum(1 for d in deltas if not d) > 0  # some steps had to hold their bytes back
    cumulative = RequestState("r", "Say:", prompt, tokenizer)
    texts = stream(cumulative, token_ids, RequestOutputKind.CUMULATIVE, per_step)
    assert all("\ufffd" not in t and TEXT.startswith(t) for t in texts) and texts[-1] == TEXT


def test_an_unfinished_character_is_flushed_at_the_end(tokenizer) -> None:
    token_ids = tokenizer("ok 🙂").input_ids[:-1]  # the emoji's last byte is missing
    state = RequestState("r", None, [1], tokenizer)
    stream(state, token_ids, RequestOutputKind.CUMULATIVE)
    assert state.completion.text.startswith("ok ") and state.completion.text.endswith("\ufffd")


def test_skip_special_tokens(tokenizer) -> None:
    token_ids = tokenizer("Hello").input_ids + [0] + tokenizer(" world").input_ids
    texts = {}
    for skip in (True, False):
        state = RequestState("r", None, [1], tokenizer, params=SamplingParams(skip_special_tokens=skip))
        stream(state, token_ids, RequestOutputKind.CUMULATIVE)
        texts[skip] = state.completion.text
    assert texts == {True: "Hello world", False: "Hello<|endoftext|> world"}


def wordpiece_tokenizer():
    """A WordPiece tokenizer: its decoder puts spaces between tokens, special ones included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[SEP]": 1, "[CLS]": 2, "hello": 3, "world": 4, "##s": 5}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]")


@pytest.mark.parametrize("spaces, expected", [(True, "[CLS] hello [SEP] [SEP] worlds"),
                                              (False, "[CLS] hello [SEP][SEP] worlds")])
def test_spaces_between_special_tokens(spaces: bool, expected: str) -> None:
    tokenizer = wordpiece_tokenizer()
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
    state = RequestState("r", None, [3], tokenizer, params=params)
    stream(state, [2, 3, 1, 1, 4, 5], RequestOutputKind.CUMULATIVE)
    assert state.completion.text.strip() == expected
    skipped = RequestState("r", None, [3], tokenizer, params=SamplingParams(spaces_between_special_tokens=spaces))
    stream(skipped, [2, 3, 1, 1, 4, 5], RequestOutputKind.CUMULATIVE)
    assert skipped.completion.text.strip() == "hello worlds"


def test_detokenize_false_leaves_the_text_empty(tokenizer) -> None:
    state = RequestState("r", None, [1], tokenizer, params=SamplingParams(detokenize=False))
    token_ids = tokenizer("Hello world").input_ids
    stream(state, token_ids, RequestOutputKind.CUMULATIVE)
    assert state.completion.text == "" and state.completion.token_ids == token_ids


def test_prompt_logprobs_in_vllms_format_and_streamed_once(tokenizer) -> None:
    from minivllm.protocol.messages import PromptLogprobs

    prompt = [5, 6, 7]
    entry = PromptLogprobs(token_ids=[[6, 9], [7, 7]], logprobs=[[-2.0, -0.5], [-0.1, -0.1]], ranks=[3, 1])
    state = RequestState("r", None, prompt, tokenizer, params=SamplingParams(output_kind=RequestOutputKind.DELTA))
    state.update(EngineCoreOutput(request_id="r", new_token_ids=[8], prompt_logprobs=entry))
    first = state.to_stream_output(RequestOutputKind.DELTA)
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(prompt)
    assert {t: (lp.logprob, lp.rank) for t, lp in first.prompt_logprobs[1].items()} == {6: (-2.0, 3), 9: (-0.5, 1)}
    assert {t: (lp.logprob, lp.rank) for t, lp in first.prompt_logprobs[2].items()} == {7: (-0.1, 1)}
    assert first.prompt_logprobs[1][6].decoded_token == tokenizer.decode([6])
    state.update(EngineCoreOutput(request_id="r", new_token_ids=[9], finish_reason="length"))
    assert state.to_stream_output(RequestOutputKind.DELTA).prompt_logprobs is None  # DELTA: only once
    assert state.to_output().prompt_logprobs == first.prompt_logprobs  # the final output has them
