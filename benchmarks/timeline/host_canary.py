"""A process apart from the engine that does a fixed bit of Python work every half millisecond and
marks, in the timeline's trace format, each time that work or its wake-up took far longer than it
should. Run beside a traced workload; step_gaps.py then lists the canary's stalls (C) inside the
engine's long steps. If the canary stalls when the engine's processes do, the host machine slowed
them all (other tenants, CPU steal); if it does not, the stall is the engine's own.

    TIMELINE_DIR=/tmp/trace python3 benchmarks/timeline/host_canary.py --seconds 90 &
    TIMELINE_DIR=/tmp/trace PYTHONPATH=benchmarks/timeline:$PYTHONPATH python3 my_driver.py
    python3 benchmarks/timeline/step_gaps.py /tmp/trace

Prints, at the end, the work unit's median and how many stalls of each kind it saw, and the
machine's CPU steal time over the run (/proc/stat) where Linux reports it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def work() -> int:
    return sum(i * i for i in range(300))  # ~10-20 us of interpreter work


def cpu_steal_ticks() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs so far, or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long it runs (SIGINT ends it sooner)")
    parser.add_argument("--work-ms", type=float, default=1.0, help="a work unit longer than this is a stall")
    parser.add_argument("--wake-ms", type=float, default=2.0, help="a 0.5 ms sleep longer than this is a stall")
    args = parser.parse_args()
    trace_dir = os.environ.get("TIMELINE_DIR")
    if not trace_dir:
        raise SystemExit("set TIMELINE_DIR (the directory the traced workload writes its marks to)")
    marks: list[str] = []
    durations: list[float] = []
    steal_before = cpu_steal_ticks()
    stop = time.perf_counter() + args.seconds
    try:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            work()
            t1 = time.perf_counter()
            time.sleep(0.0005)
            t2 = time.perf_counter()
            durations.append(t1 - t0)
            if t1 - t0 > args.work_ms / 1e3:  # (the same clock as the engine's marks: CLOCK_MONOTONIC)
                marks += [f"{t0:.6f} {os.getpid()} 0 > canary.work\n", f"{t1:.6f} {os.getpid()} 0 < canary.work\n"]
            if t2 - t1 > args.wake_ms / 1e3:
                marks += [f"{t1:.6f} {os.getpid()} 0 > canary.wake\n", f"{t2:.6f} {os.getpid()} 0 < canary.wake\n"]
    except KeyboardInterrupt:  # (SIGINT ends it early, with its marks written as at the end)
        pass
    with open(os.path.join(trace_dir, f"trace-{os.getpid()}.txt"), "w") as f:
        f.writelines(marks)
    steal_after = cpu_steal_ticks()
    stalls = {kind: sum(f"> canary.{kind}" in m for m in marks) for kind in ("work", "wake")}
    line = (f"canary: {len(durations)} units, median {statistics.median(durations) * 1e6:.1f} us; "
            f"{stalls['work']} over {args.work_ms:g} ms, {stalls['wake']} wake-ups over {args.wake_ms:g} ms")
    if steal_before and steal_after and steal_after[1] > steal_before[1]:
        share = (steal_after[0] - steal_before[0]) / (steal_after[1] - steal_before[1])
        line += f"; CPU steal {share:.2%} of all CPU time"
    print(line, flush=True)


if __name__ == "__main__":
    main()
