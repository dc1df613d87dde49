"""benchmarks/gpu_idle/gpu_idle.py on the CPU with a tiny model: the ModelRunner calls it patches
still exist and are seen in the profiled steps (a rename would break the tool, or quietly drop a
call from its report). The GPU part of the report needs CUDA."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT

TOOL = os.path.join(REPO_ROOT, "benchmarks", "gpu_idle", "gpu_idle.py")


def test_gpu_idle_tool_profiles_the_worker(tiny_llama: str) -> None:
    result = subprocess.run([sys.executable, TOOL, "--steps", "3", "--min-new", "0", "--", "--model", tiny_llama,
                             "--num-prompts", "4", "--input-len", "8:16", "--output-len", "4"],
                            capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("GPU_IDLE host calls seen:"))
    calls = ast.literal_eval(line.split(":", 1)[1].strip())
    assert calls["run_step"] == 3 and all(count > 0 for count in calls.values()), calls
    assert "GPU_IDLE no GPU kernels recorded" in result.stdout
