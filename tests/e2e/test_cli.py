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
    from frontend import LLM, SamplingParams

    with LLM(tiny_llama, max_model_len=128) as llm:
        expected = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    result = run("generate", "--model", tiny_llama, "--max-tokens", "8", "--max-model-len", "128", "Hello")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.outputs[0].text + "\n"


def test_help_documents_every_flag() -> None:
    for command in ("generate", "engine"):
        result = run(command, "--help")
        assert result.returncode == 0
        for flag in ("--model", "--max-num-batched-tokens", "--max-num-seqs", "--block-size",
                     "--num-gpu-blocks", "--max-model-len", "--device", "--dtype", "--load-format", "--seed"):
            assert flag in result.stdout
    assert "--temperature" in run("generate", "--help").stdout


def test_bad_flag_value_is_a_clear_error(tiny_llama) -> None:
    result = run("generate", "--model", tiny_llama, "--temperature", "-1", "Hello")
    assert result.returncode == 2
    assert "temperature must be >= 0" in result.stderr
    assert "Traceback" not in result.stderr
