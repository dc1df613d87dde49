"""benchmarks/prefix_turn.py on the CPU with a tiny model: it times a fresh prompt and turns after
cached prefixes, and the turns really are served from the prefix cache (the tool checks
num_cached_tokens and fails otherwise)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import REPO_ROOT

TOOL = os.path.join(REPO_ROOT, "benchmarks", "prefix_turn.py")


def test_prefix_turn_tool_times_cached_turns(tiny_llama: str) -> None:
    result = subprocess.run([sys.executable, TOOL, "--model", tiny_llama, "--prefix-lens", "64,96",
                             "--new-lens", "8", "--iters", "2"],
                            capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"^fresh prompt of 8 tokens: first token [0-9.]+ ms$", result.stdout, re.M), result.stdout
    for prefix_len in (64, 96):
        assert re.search(rf"^  after {prefix_len} cached tokens: first token [0-9.]+ ms \(\+-?[0-9.]+\)$",
                         result.stdout, re.M), result.stdout
