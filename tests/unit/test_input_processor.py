"""InputProcessor: bad_words become token-id sequences as vLLM makes them, the user's params untouched."""

from __future__ import annotations

import msgspec
import pytest

from minivllm.frontend.input_processor import InputProcessor, TokenizerLoad
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


def test_prompt_token_ids_are_copied_as_ints_and_checked() -> None:
    processor = InputProcessor(INFO, None)
    ids = [5, 6, 7]
    request, _ = processor.process("r", {"prompt_token_ids": ids}, SamplingParams())
    assert request.prompt_token_ids == ids and request.prompt_token_ids is not ids
    request, _ = processor.process("r", {"prompt_token_ids": (True, 3)}, SamplingParams())  # bools are ints
    assert request.prompt_token_ids == [1, 3] and all(type(t) is int for t in request.prompt_token_ids)
    for bad in ([1, 2.0], [1, "2"], [None], "12"):
        with pytest.raises(ValueError, match="prompt_token_ids must be a list of ints"):
            processor.process("r", {"prompt_token_ids": bad}, SamplingParams())
    with pytest.raises(ValueError, match=r"prompt token 512 is outside the vocabulary; ids must be in \[0, 512\)"):
        processor.process("r", {"prompt_token_ids": [1, 512]}, SamplingParams())
    with pytest.raises(ValueError, match="prompt token -1 is outside"):
        processor.process("r", {"prompt_token_ids": [True, -1]}, SamplingParams())


def test_a_tokenizer_loaded_beside_the_engine_is_the_one_used(tokenizer, tmp_path) -> None:
    """LLM and AsyncLLM start the tokenizer's load (TokenizerLoad) before they wait for the engine;
    for_engine takes that tokenizer when it is the engine's, loads the engine's otherwise, and
    raises what a failed load raised."""
    path = str(tmp_path / "tok")
    tokenizer.save_pretrained(path)
    info = msgspec.structs.replace(INFO, tokenizer=path)
    loading = TokenizerLoad(path)
    processor = InputProcessor.for_engine(info, False, loading)
    assert processor.tokenizer is loading.result()
    other = TokenizerLoad(str(tmp_path / "missing"))  # not the engine's: for_engine loads the engine's
    processor = InputProcessor.for_engine(info, False, other)
    assert processor.tokenizer is not None and processor.tokenizer.encode("Hello") == tokenizer.encode("Hello")
    assert InputProcessor.for_engine(info, True, loading).tokenizer is None
    with pytest.raises(OSError):
        InputProcessor.for_engine(msgspec.structs.replace(INFO, tokenizer=other.path), False, other)
