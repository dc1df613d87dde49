"""Timing GPU work as the engine runs it: captured in a CUDA graph and replayed, so that a kernel of
a few microseconds is timed on the GPU, not through the host's launches."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_time_us(fn: Callable[[], object], calls: int = 1, replays: int = 13, warmup: int = 3) -> float:
    """Microseconds of one fn(): the median over `replays` replays (the first `warmup` left out) of
    a CUDA graph that holds `calls` calls of fn back to back, divided by `calls`. fn runs three
    times on a side stream first, so that whatever it compiles is compiled outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times[warmup:])
