"""Which decode steps of a throughput run were long, and what ran long in every process while they
were: read from the marks sitecustomize.py leaves in $TIMELINE_DIR (see request_timeline.py).

    TIMELINE_DIR=/tmp/trace PYTHONPATH=benchmarks/timeline:$PYTHONPATH python3 my_driver.py
    python3 benchmarks/timeline/step_gaps.py /tmp/trace [--skip 12] [--long-ms 7]

A window is what the driver marks with `__timeline_mark__("> rep N")` and `("< rep N")` (builtins,
set by sitecustomize.py); without such marks the whole trace is one window. A step is the interval
from one `ModelRunner.run_step` entry to the next. For each window: the steps, each marked call's
count, total and largest time, and every step after the first --skip (the prompt steps) longer than
--long-ms, with the host-work calls over --call-ms that began in it or up to 10 ms before. W marks the
worker's calls, E the EngineCore's, F the frontend's, C host_canary.py's stalls; calls that mostly
wait (WAITING) are left out of that list. A long step whose calls ran long in every process at once
points at the host machine, not at one process's work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from request_timeline import read_marks  # noqa: E402

STEP = "ModelRunner.run_step"
PROCESS_OF = {"ModelRunner": "W", "InputBatch": "W", "StepBuffers": "W", "StepGraphs": "W", "run_forward": "W",
              "Scheduler": "E", "EngineCore": "E", "EngineCoreProc": "E", "ChannelExecutor": "E",
              "UniProcExecutor": "E", "EngineCoreClient": "F", "OutputProcessor": "F", "LLM": "F",
              "canary": "C"}  # host_canary.py
# Calls that mostly wait (on the GPU, a socket, or calls inside them): counted, but not listed in a long step
WAITING = {"ModelRunner.run_step", "ModelRunner.finish_pending", "ChannelExecutor.receive_output",
           "UniProcExecutor.receive_output", "EngineCore.step_async", "EngineCoreClient._receive",
           "EngineCoreProc._receive_frames", "LLM._run", "StepGraphs.run", "ModelRunner._run_model"}


def spans(marks: list[tuple[float, str, str, str]]) -> dict[str, list[tuple[float, float]]]:
    """(entry, exit) of every marked call, by the call's name."""
    open_calls: dict[tuple[str, str, str], float] = {}
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t, pid, thread, label in marks:
        side, _, name = label.partition(" ")
        if side == ">":
            open_calls[(pid, thread, name)] = t
        elif side == "<" and (pid, thread, name) in open_calls:
            out[name].append((open_calls.pop((pid, thread, name)), t))
    return out


def windows(calls: dict[str, list[tuple[float, float]]]) -> list[tuple[str, float, float]]:
    reps = sorted((start, end, name) for name, found in calls.items() if name.startswith("rep ")
                  for start, end in found)
    if reps:
        return [(name, start, end) for start, end, name in reps]
    every = [t for found in calls.values() for span in found for t in span]
    return [("whole trace", min(every), max(every))]


def report(trace_dir: str, skip: int, long_ms: float, call_ms: float = 1.5) -> None:
    calls = spans(read_marks(trace_dir))
    if STEP not in calls:
        raise SystemExit(f"no {STEP} marks in {trace_dir}: was the worker started with benchmarks/timeline on PYTHONPATH?")
    named = {name: found for name, found in calls.items() if not name.startswith("rep ")}
    for window, start, end in windows(calls):
        starts = [s for s, _ in calls[STEP] if start <= s <= end]
        decode = [(starts[i + 1] - starts[i], starts[i]) for i in range(skip, len(starts) - 1)]
        if not decode:
            print(f"{window}: {len(starts)} steps, none after the first {skip}")
            continue
        print(f"{window}: {(end - start) * 1e3:.1f} ms, {len(starts)} steps; decode steps (from step {skip}): "
              f"median {statistics.median(g for g, _ in decode) * 1e3:.2f} ms, "
              f"{sum(g > long_ms / 1e3 for g, _ in decode)} over {long_ms:g} ms")
        for name in sorted(named):
            took = [e - s for s, e in named[name] if start <= s <= end]
            if took:
                print(f"    {name:34} n {len(took):4}  total {sum(took) * 1e3:8.1f} ms  largest {max(took) * 1e3:6.2f} ms")
        for gap, step_start in decode:
            if gap <= long_ms / 1e3:
                continue
            inside = []
            for name, found in named.items():
                if name in WAITING:
                    continue
                who = PROCESS_OF.get(name.split(".")[0], "?")
                for s, e in found:  # (10 ms before: the EngineCore works up to two steps ahead)
                    if step_start - 0.010 <= s < step_start + gap and e - s > call_ms / 1e3:
                        inside.append((s, f"{who} {name.split('.')[-1]} {(e - s) * 1e3:.1f}@{(s - step_start) * 1e3:+.1f}"))
            print(f"  step at {(step_start - start) * 1e3:7.1f} ms took {gap * 1e3:5.1f} ms: "
                  + ", ".join(text for _, text in sorted(inside)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--skip", type=int, default=12, help="steps at a window's start not reported (its prompt steps)")
    parser.add_argument("--long-ms", type=float, default=7.0, help="a decode step longer than this is listed")
    parser.add_argument("--call-ms", type=float, default=1.5, help="a host call longer than this is named in a long step")
    args = parser.parse_args()
    report(args.trace_dir, args.skip, args.long_ms, args.call_ms)


if __name__ == "__main__":
    main()
