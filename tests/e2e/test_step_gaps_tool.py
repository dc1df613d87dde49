"""benchmarks/timeline/step_gaps.py and host_canary.py on CPU with a tiny model: a traced run's
window, its steps, and the calls of every process (and the canary's stalls) named inside them. A
rename of a marked call, or of the rep marks a driver makes, would otherwise leave the tool
silently reporting nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from tests.conftest import REPO_ROOT

TIMELINE = os.path.join(REPO_ROOT, "benchmarks", "timeline")

DRIVER = textwrap.dedent("""
    import builtins, sys
    from minivllm.frontend.llm import LLM
    from minivllm.protocol.sampling_params import SamplingParams

    mark = builtins.__timeline_mark__
    with LLM(sys.argv[1], skip_tokenizer_init=True) as llm:
        prompts = [{"prompt_token_ids": [10 + (7 * i + j) % 50 for j in range(12 + i)]} for i in range(4)]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        llm.generate(prompts[:1], params, use_tqdm=False)
        mark("> rep 0")
        llm.generate(prompts, params, use_tqdm=False)
        mark("< rep 0")
""")


def test_step_gaps_names_every_process_in_a_traced_run(tiny_llama: str, tmp_path) -> None:
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, TIMELINE_DIR=str(trace_dir),
               PYTHONPATH=os.pathsep.join(p for p in (TIMELINE, os.environ.get("PYTHONPATH")) if p))
    # --work-ms 0: every unit of the canary's work is marked, so some fall inside every step
    canary = subprocess.Popen([sys.executable, os.path.join(TIMELINE, "host_canary.py"), "--seconds", "600",
                               "--work-ms", "0"], env=dict(os.environ, TIMELINE_DIR=str(trace_dir)),
                              stdout=subprocess.PIPE, text=True)
    try:
        run = subprocess.run([sys.executable, str(driver), tiny_llama], env=env, capture_output=True, text=True,
                             timeout=300, cwd=REPO_ROOT)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        canary.send_signal(signal.SIGINT)
        canary_out, _ = canary.communicate(timeout=60)
    assert canary.returncode == 0 and canary_out.startswith("canary: "), canary_out
    # frontend, EngineCore, worker and the canary: a file of marks each
    assert len(os.listdir(trace_dir)) == 4, os.listdir(trace_dir)

    report = subprocess.run([sys.executable, os.path.join(TIMELINE, "step_gaps.py"), str(trace_dir), "--skip", "1",
                             "--long-ms", "0", "--call-ms", "0"], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stdout[-3000:] + report.stderr[-3000:]
    lines = report.stdout.splitlines()
    assert lines[0].startswith("rep 0: ") and " steps; decode steps (from step 1)" in lines[0], lines[0]
    for call in ("Scheduler.schedule", "InputBatch.prepare", "OutputProcessor.process_outputs", "canary.work"):
        assert any(line.split()[:1] == [call] for line in lines), (call, report.stdout)
    steps = [line for line in lines if line.startswith("  step at ")]
    assert len(steps) >= 20, report.stdout  # 24 tokens: ~23 decode steps after the first
    named = " ".join(steps)
    for who in ("W prepare", "E schedule", "F process_outputs", "C work"):
        assert who in named, (who, report.stdout)


def test_canary_marks_a_window_whose_work_ran_slow() -> None:
    """The canary's `slow` windows: a stretch where every unit of its work took 3x as long (a CPU shared
    with a neighbour) is one window; the same stretch at the usual pace, or one slow unit, is none. Its
    `mem` marks: the memory reads over twice their median."""
    sys.path.insert(0, TIMELINE)
    try:
        from host_canary import over_median, slow_windows
    finally:
        sys.path.remove(TIMELINE)
    usual = [(i * 0.0005, 20e-6) for i in range(200)]  # 0.1 s of 20 us units, one every 0.5 ms
    slowed = [(t, d * 3 if 0.050 <= t < 0.060 else d) for t, d in usual]
    assert slow_windows(usual, 0.010, 2.0) == []
    assert [(round(a, 3), round(b, 3)) for a, b in slow_windows(slowed, 0.010, 2.0)] == [(0.05, 0.06)]
    one_slow = [(t, d * 50 if i == 101 else d) for i, (t, d) in enumerate(usual)]
    assert slow_windows(one_slow, 0.010, 2.0) == []
    # the memory probe's passes: only the one at 3x the median is marked
    passes = [(i * 0.02, 1.5e-3) for i in range(10)] + [(0.2, 4.5e-3), (0.22, 2.9e-3)]
    assert over_median(passes, 2.0) == [(0.2, 0.2 + 4.5e-3)]
