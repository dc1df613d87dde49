"""The EngineCore's own host work per decode step, without a model: N running requests through
Scheduler.schedule(), update_from_output() with one sampled token each, and the encoding of the
outputs for the frontend. Under distributed_executor_backend="uni" this work and the model
runner's take turns on one thread, so at large batches it is part of the step; under "mp" it runs
beside the worker's and must fit in the GPU's step time. No torch, no device.

    python benchmarks/scheduler_step.py [--batch 256] [--context 600] [--steps 300] [--steps-in-flight 3]

As the busy loop does with async scheduling, each step is scheduled while the previous ones'
tokens are still out (--steps-in-flight, the engine's default 3; 1: schedule, then update).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

from minivllm.core.scheduler import Scheduler
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import EngineCoreOutputs, EngineCoreRequest, ModelRunnerOutput
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.serial import encode


def finish_oldest(scheduler: Scheduler, in_flight: deque) -> list:
    """The oldest step in flight's tokens, one sampled token a row, through update_from_output."""
    oldest = in_flight.popleft()
    req_ids = list(oldest.num_scheduled_tokens)
    return scheduler.update_from_output(oldest, ModelRunnerOutput(req_ids=req_ids,
                                                                  sampled_token_ids=[7] * len(req_ids)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=600, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--steps-in-flight", type=int, default=3)
    args = parser.parse_args()

    block_size = 16
    max_model_len = args.context + args.steps + 64
    config = EngineConfig(model="none", tokenizer="none", max_model_len=max_model_len, vocab_size=32000,
                          eos_token_ids=[2], block_size=block_size, max_num_seqs=args.batch,
                          max_num_batched_tokens=max(8192, args.batch))
    scheduler = Scheduler(config, args.batch * -(-max_model_len // block_size) + 16)
    params = SamplingParams(max_tokens=args.steps + 50, ignore_eos=True)
    for i in range(args.batch):
        prompt = [10 + (i * 7919 + j) % 30000 for j in range(args.context)]
        scheduler.add_request(EngineCoreRequest(request_id=f"req-{i}", prompt_token_ids=prompt,
                                                sampling_params=params, arrival_time=0.0, eos_token_ids=[2]))

    timings: dict[str, list[float]] = {"schedule": [], "update_from_output": [], "encode outputs": []}

    in_flight: deque = deque()

    def step(record: bool) -> int:
        """Schedule a step; once args.steps_in_flight are out, take the oldest one's tokens."""
        t0 = time.perf_counter()
        scheduler_output = scheduler.schedule()
        in_flight.append(scheduler_output)
        t1 = time.perf_counter()
        t2 = t3 = t1
        if len(in_flight) >= args.steps_in_flight:
            outputs = finish_oldest(scheduler, in_flight)
            t2 = time.perf_counter()
            encode(EngineCoreOutputs(outputs=outputs))
            t3 = time.perf_counter()
        if record:
            for name, seconds in zip(timings, (t1 - t0, t2 - t1, t3 - t2)):
                timings[name].append(seconds)
        return scheduler_output.total_num_scheduled_tokens

    while step(record=False) != args.batch:  # the prompts' steps
        pass
    for _ in range(args.steps):
        step(record=True)
    total = sum(statistics.median(samples) for samples in timings.values())
    print(f"batch {args.batch}, context ~{args.context}, {args.steps_in_flight} step(s) in flight: "
          f"{total * 1e6:.0f} us of engine work per decode step (medians)")
    for name, samples in timings.items():
        print(f"  {name:20s} {statistics.median(samples) * 1e6:7.0f} us")


if __name__ == "__main__":
    main()
