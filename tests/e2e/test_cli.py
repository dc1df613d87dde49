"""The `minivllm` command line."""

from __future__ import annotations

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINIVLLM = [sys.executable, os.path.join(REPO_ROOT, "bin", "minivllm")]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MINIVLLM, *args], capture_output=True, text=True, timeout=120)


def test_generate_prints_the_completion(tiny_llama) -> None:
    from minivllm import LLM, SamplingParams

    with LLM(tiny_llama, max_model_len=128) as llm:
        expected = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    result = run("generate", "--model", tiny_llama, "--max-tokens", "8", "--max-model-len", "128", "Hello")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.outputs[0].text + "\n"


def test_generate_answers_through_the_chat_template_unless_no_chat(tiny_chat_llama) -> None:
    from minivllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8)
    with LLM(tiny_chat_llama, max_model_len=128) as llm:
        chat = llm.chat([{"role": "user", "content": "Hello"}], params, use_tqdm=False)[0]
        raw = llm.generate("Hello", params, use_tqdm=False)[0]
    assert chat.prompt_token_ids != raw.prompt_token_ids  # the two modes really differ
    flags = ["generate", "--model", tiny_chat_llama, "--max-tokens", "8", "--max-model-len", "128"]
    result = run(*flags, "Hello")
    assert result.returncode == 0, result.stderr
    assert result.stdout == chat.outputs[0].text + "\n"
    result = run(*flags, "--no-chat", "Hello")
    assert result.returncode == 0, result.stderr
    assert result.stdout == raw.outputs[0].text + "\n"


def test_missing_model_path_is_a_clear_error(tmp_path) -> None:
    for model in (str(tmp_path / "nowhere"), str(tmp_path / "nowhere.gguf")):
        result = run("generate", "--model", model, "Hello")
        assert result.returncode == 2 and model in result.stderr
        assert "Traceback" not in result.stderr


def test_help_documents_every_flag() -> None:
    for command in ("generate", "engine"):
        result = run(command, "--help")
        assert result.returncode == 0
        for flag in ("--model", "--max-num-batched-tokens", "--max-num-seqs", "--block-size",
                     "--num-gpu-blocks", "--max-model-len", "--device", "--dtype", "--load-format", "--seed"):
            assert flag in result.stdout
    assert "--temperature" in run("generate", "--help").stdout
    assert "--no-chat" in run("generate", "--help").stdout
    assert "--force" in run("download", "--help").stdout


def test_bad_flag_value_is_a_clear_error(tiny_llama) -> None:
    result = run("generate", "--model", tiny_llama, "--temperature", "-1", "Hello")
    assert result.returncode == 2
    assert "temperature must be >= 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_engine_refuses_data_parallelism(tiny_llama) -> None:
    """One `minivllm engine` is one engine core at one address: asking it for N is refused, not
    silently ignored."""
    result = run("engine", "--model", tiny_llama, "--data-parallel-size", "2")
    assert result.returncode == 2
    assert "--data-parallel-size must be 1" in result.stderr
