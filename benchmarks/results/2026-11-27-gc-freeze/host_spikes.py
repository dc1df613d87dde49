"""The EngineCore's host work step by step over the whole 256-request workload (prompts 100-1024,
outputs 256, as bench throughput and run_edges.py make them), without a model: the real Scheduler
with deferred block updates (as EngineCoreProc sets it), three steps in flight, one sampled token per
row. Each loop iteration is timed by part (schedule, update_from_output, encoding the outputs,
apply_deferred_block_updates), and the collector's passes are recorded (gc.callbacks). Prints the
longest iterations: on the H100 the GPU idles when one takes longer than the steps in flight
(~10 ms in FP8 decode). No torch, no device.

    python benchmarks/results/2026-11-27-gc-freeze/host_spikes.py [--freeze]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections import deque

import numpy as np

from minivllm.core.scheduler import Scheduler
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import EngineCoreOutputs, EngineCoreRequest
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.serial import encode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from scheduler_step import finish_oldest  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--freeze", action="store_true", help="gc.freeze() once the scheduler is built")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    in_lens = rng.integers(100, 1025, size=256)
    config = EngineConfig(model="none", tokenizer="none", max_model_len=2048, vocab_size=151936, eos_token_ids=[2],
                          block_size=16, max_num_seqs=256, max_num_batched_tokens=16384)
    scheduler = Scheduler(config, 256 * 2048 // 16 + 16)
    scheduler.defer_block_updates = True
    if args.freeze:
        gc.collect()
        gc.freeze()
    passes: list[tuple[float, int, float]] = []  # (start, generation, seconds)
    started: dict = {}

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            passes.append((started["t"], info["generation"], time.perf_counter() - started["t"]))
    gc.callbacks.append(on_gc)

    params = SamplingParams(max_tokens=256, ignore_eos=True)
    for i, n in enumerate(in_lens):
        prompt = rng.integers(0, 151000, size=int(n)).tolist()
        scheduler.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                                arrival_time=0.0, eos_token_ids=[2]))
    in_flight: deque = deque()
    iterations = []  # (index, tokens scheduled, [schedule, update, encode, deferred], start)
    index = 0
    while scheduler.has_unfinished_requests() or in_flight:
        t0 = time.perf_counter()
        scheduled = scheduler.schedule() if scheduler.has_unfinished_requests() else None
        new_step = scheduled is not None and scheduled.total_num_scheduled_tokens > 0
        if new_step:
            in_flight.append(scheduled)
        t1 = t2 = t3 = time.perf_counter()
        if len(in_flight) >= 3 or (in_flight and not new_step):  # (nothing new: the oldest step's tokens are awaited)
            outputs = finish_oldest(scheduler, in_flight)
            t2 = time.perf_counter()
            encode(EngineCoreOutputs(outputs=outputs))
            t3 = time.perf_counter()
        scheduler.apply_deferred_block_updates()
        t4 = time.perf_counter()
        iterations.append((index, scheduled.total_num_scheduled_tokens if scheduled else 0,
                           [t1 - t0, t2 - t1, t3 - t2, t4 - t3], t0))
        index += 1
        if index > 2000:
            raise RuntimeError("the workload did not finish")
    gc.callbacks.remove(on_gc)
    totals = np.array([sum(parts) for _, _, parts, _ in iterations])
    print(f"{len(iterations)} iterations, host work {totals.sum() * 1e3:.0f} ms in all, median "
          f"{np.median(totals) * 1e3:.2f} ms; {'frozen' if args.freeze else 'collector as is'}; "
          f"collector passes over 1 ms: {sum(1 for *_, s in passes if s > 1e-3)}, "
          f"{sum(s for *_, s in passes) * 1e3:.0f} ms in all passes")
    print("longest iterations (ms: schedule, update, encode, deferred updates; collector passes inside):")
    for i in np.argsort(-totals)[:args.top]:
        index, tokens, parts, start = iterations[i]
        inside = [f"gen{g} {s * 1e3:.1f}" for t, g, s in passes if start <= t <= start + totals[i]]
        print(f"  #{index:4d} {tokens:6d} tokens  {totals[i] * 1e3:6.2f} ms = "
              + " + ".join(f"{p * 1e3:.2f}" for p in parts) + (f"   [{', '.join(inside)}]" if inside else ""))


if __name__ == "__main__":
    main()
