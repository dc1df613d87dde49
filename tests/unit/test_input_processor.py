"""InputProcessor: bad_words become token-id sequences as vLLM makes them, the user's params untouched."""

from __future__ import annotations

import pytest

from minivllm.frontend.input_processor import InputProcessor
from minivllm.protocol.messages import EngineInfo
from minivllm.protocol.sampling_params import SamplingParams
from tests.tiny_models import build_tiny_tokenizer

INFO = EngineInfo(model="m", tokenizer="t", max_model_len=64, vocab_size=512, eos_token_ids=[0], block_size=16,
                  num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, engine_pid=0, worker_pids=[])


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_bad_words_are_tokenized_with_and_without_a_leading_space(tokenizer) -> None:
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    params = SamplingParams(bad_words=["is is", "Fr", " France"])
    request, _ = InputProcessor(INFO, tokenizer).process("r", "Hello", params)
    assert params._bad_words_token_ids is None  # the user's object is not changed
    expected = [
        encode("is is"), encode(" is is"),  # same length, another first token: both
        encode("Fr"), encode(" Fr"),
        # "France" is two tokens, " France" one: vLLM keeps only the bare form (the leading space of
        # a bad word is stripped first).
        encode("France"),
    ]
    assert len(encode("France")) == 2 and len(encode(" France")) == 1
    assert request.sampling_params._bad_words_token_ids == expected
    assert request.sampling_params.processes_logits


def test_bad_words_need_the_tokenizer() -> None:
    with pytest.raises(ValueError, match="bad_words must be a list of non-blank strings"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(ValueError, match="bad_words need the tokenizer"):
        InputProcessor(INFO, None).process("r", {"prompt_token_ids": [1, 2]}, SamplingParams(bad_words=["x"]))
