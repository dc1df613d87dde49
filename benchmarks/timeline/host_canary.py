"""A process apart from the engine that does a fixed bit of Python work every half millisecond (and
maps a fresh 256 KiB, and now and then reads 32 MiB), and marks in the timeline's trace format each
time that took far longer than it should. Run beside a traced workload; step_gaps.py then lists the
canary's stalls (C) inside the engine's long steps. If the canary stalls when the engine's processes
do, the host machine slowed them all (other tenants, CPU steal); if it does not, the stall is the
engine's own.

Five kinds of stall are marked:
- `work`: one unit of interpreter work over --work-ms (the canary was descheduled);
- `wake`: a 0.5 ms sleep over --wake-ms;
- `slow`: a --window-ms window whose units' median ran over --slow-x times the run's (the CPU ran
  slower for a while, as when a neighbour shares its core or its cache);
- `alloc`: a fresh, touched 256 KiB that took over --alloc-ms (the kernel's page allocator stalled,
  as in reclaim or compaction, which hits only processes that take new memory);
- `mem`: every --mem-every-ms, a read of one byte per cache line of 32 MiB that took over --slow-x
  times its median (the memory system served this core slower, as when a neighbour floods the shared
  cache or DRAM; the interpreter work above lives in L1 and would not show that).

    TIMELINE_DIR=/tmp/trace python3 benchmarks/timeline/host_canary.py --seconds 90 &
    TIMELINE_DIR=/tmp/trace PYTHONPATH=benchmarks/timeline:$PYTHONPATH python3 my_driver.py
    python3 benchmarks/timeline/step_gaps.py /tmp/trace

Prints, at the end, the work unit's median and how many stalls of each kind it saw, /proc/vmstat's
memory-stall counters that moved, and the machine's CPU steal time over the run (/proc/stat) where
Linux reports it.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from collections import Counter


def work() -> int:
    return sum(i * i for i in range(300))  # ~10-20 us of interpreter work


def alloc() -> None:
    # An anonymous map of its own (malloc would reuse its heap's pages): 64 fresh pages, each faulted in.
    with mmap.mmap(-1, 1 << 18) as block:
        for offset in range(0, 1 << 18, 4096):
            block[offset] = 1


class MemoryProbe:
    """Reads one byte of every 64-byte line of a 32 MiB buffer (numpy: the pass is memory-bound, not
    interpreter-bound). Raises ImportError without numpy; the canary then runs without it."""

    def __init__(self) -> None:
        import numpy as np

        self.buffer = np.ones(32 << 20, dtype=np.uint8)
        self.lines = self.buffer[::64]

    def read(self) -> int:
        return int(self.lines.sum())


def over_median(passes: list[tuple[float, float]], times: float) -> list[tuple[float, float]]:
    """(start, end) of the passes that took over `times` their median."""
    if not passes:
        return []
    typical = statistics.median(d for _, d in passes)
    return [(t0, t0 + d) for t0, d in passes if d > times * typical]


# /proc/vmstat counters that move when the kernel makes a process wait for memory
VMSTAT_STALLS = ("allocstall_normal", "allocstall_movable", "compact_stall", "pgscan_direct", "pgmajfault",
                 "pswpin", "pswpout", "thp_fault_alloc", "thp_fault_fallback", "thp_collapse_alloc")


def vmstat() -> dict[str, int]:
    try:
        with open("/proc/vmstat") as f:
            pairs = (line.split() for line in f)
            return {name: int(value) for name, value in pairs if name in VMSTAT_STALLS}
    except (OSError, ValueError):
        return {}


def slow_windows(units: list[tuple[float, float]], window_s: float, slow_x: float) -> list[tuple[float, float]]:
    """(start, end) of each window whose units' median took over slow_x times the run's median."""
    if not units:
        return []
    typical = statistics.median(d for _, d in units)
    by_window: dict[int, list[float]] = {}
    for t0, d in units:
        by_window.setdefault(int(t0 / window_s), []).append(d)
    return [(w * window_s, (w + 1) * window_s) for w, found in sorted(by_window.items())
            if len(found) >= 3 and statistics.median(found) > slow_x * typical]


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
    parser.add_argument("--alloc-ms", type=float, default=2.0, help="a fresh 256 KiB slower than this is a stall")
    parser.add_argument("--window-ms", type=float, default=10.0, help="the window a slow median is judged over")
    parser.add_argument("--slow-x", type=float, default=2.0,
                        help="a window (or memory read) this many times the median is slow")
    parser.add_argument("--mem-every-ms", type=float, default=20.0, help="how often the memory probe reads")
    args = parser.parse_args()
    trace_dir = os.environ.get("TIMELINE_DIR")
    if not trace_dir:
        raise SystemExit("set TIMELINE_DIR (the directory the traced workload writes its marks to)")
    marks: list[str] = []
    stalls: Counter[str] = Counter()

    def stall(kind: str, start: float, end: float) -> None:
        # (the same clock as the engine's marks: CLOCK_MONOTONIC, in the trace format sitecustomize.py writes)
        marks.extend((f"{start:.6f} {os.getpid()} 0 > canary.{kind}\n", f"{end:.6f} {os.getpid()} 0 < canary.{kind}\n"))
        stalls[kind] += 1

    units: list[tuple[float, float]] = []  # (start, duration) of every work unit
    alloc_durations: list[float] = []
    mem_passes: list[tuple[float, float]] = []
    try:
        memory: MemoryProbe | None = MemoryProbe()
    except ImportError:
        memory = None
    next_mem = 0.0
    steal_before, vm_before = cpu_steal_ticks(), vmstat()
    stop = time.perf_counter() + args.seconds
    try:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            work()
            t1 = time.perf_counter()
            time.sleep(0.0005)
            t2 = time.perf_counter()
            alloc()
            t3 = time.perf_counter()
            units.append((t0, t1 - t0))
            alloc_durations.append(t3 - t2)
            if memory is not None and t3 >= next_mem:
                memory.read()
                mem_passes.append((t3, time.perf_counter() - t3))
                next_mem = t3 + args.mem_every_ms / 1e3
            if t1 - t0 > args.work_ms / 1e3:
                stall("work", t0, t1)
            if t2 - t1 > args.wake_ms / 1e3:
                stall("wake", t1, t2)
            if t3 - t2 > args.alloc_ms / 1e3:
                stall("alloc", t2, t3)
    except KeyboardInterrupt:  # (SIGINT ends it early, with its marks written as at the end)
        pass
    for start, end in slow_windows(units, args.window_ms / 1e3, args.slow_x):
        stall("slow", start, end)
    for start, end in over_median(mem_passes, args.slow_x):
        stall("mem", start, end)
    with open(os.path.join(trace_dir, f"trace-{os.getpid()}.txt"), "w") as f:
        f.writelines(marks)
    steal_after, vm_after = cpu_steal_ticks(), vmstat()
    line = (f"canary: {len(units)} units, median {statistics.median(d for _, d in units) * 1e6:.1f} us; "
            f"{stalls['work']} over {args.work_ms:g} ms, {stalls['wake']} wake-ups over {args.wake_ms:g} ms, "
            f"{stalls['slow']} slow {args.window_ms:g} ms windows (median over {args.slow_x:g}x); "
            f"fresh 256 KiB median {statistics.median(alloc_durations) * 1e6:.1f} us, {stalls['alloc']} over "
            f"{args.alloc_ms:g} ms")
    if mem_passes:
        line += (f"; 32 MiB read median {statistics.median(d for _, d in mem_passes) * 1e6:.1f} us, "
                 f"{stalls['mem']} of {len(mem_passes)} over {args.slow_x:g}x")
    moved = {name: vm_after[name] - vm_before[name] for name in vm_after if vm_after[name] != vm_before.get(name)}
    line += "; vmstat: " + (", ".join(f"{name} +{n}" for name, n in moved.items()) or "no stall counter moved")
    if steal_before and steal_after and steal_after[1] > steal_before[1]:
        share = (steal_after[0] - steal_before[0]) / (steal_after[1] - steal_before[1])
        line += f"; CPU steal {share:.2%} of all CPU time"
    print(line, flush=True)


if __name__ == "__main__":
    main()
