"""benchmarks/timeline/request_timeline.py on CPU with a tiny model: the marks it patches into the
frontend, the EngineCore and the worker still find their functions (a rename would break the
tool, or quietly drop a stage), and every stage of a request's way gets a time."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

TOOL = os.path.join(REPO_ROOT, "benchmarks", "timeline", "request_timeline.py")


@pytest.mark.parametrize("backend", ["mp", "uni"])
def test_request_timeline_times_every_stage(tiny_llama: str, tmp_path, backend: str) -> None:
    from benchmarks.timeline.request_timeline import STAGES

    result = subprocess.run([sys.executable, TOOL, "--model", tiny_llama, "--input-len", "24", "--num-iters", "3",
                             "--trace-dir", str(tmp_path), "--distributed-executor-backend", backend],
                            capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "3 iterations: time to first token median" in result.stdout
    # On the CPU the worker hands the sampled token back inside run_step: no held-back token. With
    # the worker in the engine ("uni") no step is sent to it.
    absent = {"worker: sampled token on the host"} | ({"submitted to the worker"} if backend == "uni" else set())
    expected = [name for name, _ in STAGES if name not in absent]
    missing = [name for name in expected if f"  {name} " not in result.stdout]
    assert not missing, result.stdout
    # one file of marks per process: frontend, engine, worker (uni: no worker process)
    assert len(os.listdir(tmp_path)) == (3 if backend == "mp" else 2)
