"""Where a decode step's host time goes in the worker, stage by stage (GPU only).

Drives the worker's ModelRunner in-process as the worker runs it (tokens held back, the next step
launched before the previous one's tokens are read) over N decoding requests, and times named
calls with perf_counter wrappers: preparing the inputs, copying them in, patching input ids from
the device, replaying the graphs, sampling, waiting for the held-back tokens. With
--no-instrument only run_step's own time and the wait for the GPU are reported (the wrappers
add a little).

    python benchmarks/worker_step_host.py [--batch 1] [--context 128] [--temperature 1.0]

run_step's median tells which side bounds the step: when the worker waits for the GPU's tokens
for a good part of it, the GPU does; when it hardly waits, its own host work does.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import numpy as np
import torch

import minivllm.worker.cuda_graphs as cuda_graphs
import minivllm.worker.fused_sampling as fused_sampling
import minivllm.worker.input_batch as input_batch
import minivllm.worker.model_runner as model_runner
import minivllm.worker.sampler as sampler
import minivllm.worker.step_buffers as step_buffers
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.protocol.sampling_params import SamplingParams

TIMED = [(model_runner.ModelRunner, "run_step"), (model_runner.ModelRunner, "_update_states"),
         (input_batch.InputBatch, "prepare"), (step_buffers.StepBuffers, "load"),
         (model_runner.ModelRunner, "_patch_pending_inputs"), (torch.cuda.CUDAGraph, "replay"),
         (model_runner.ModelRunner, "_sample"), (sampler.Sampler, "sample_rows"),
         (fused_sampling, "fused_sample"), (model_runner.ModelRunner, "finish_pending"),
         (input_batch.InputBatch, "append_pending"), (cuda_graphs.StepGraphs, "run")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--no-instrument", action="store_true")
    args = parser.parse_args()

    times: dict[str, list[float]] = collections.defaultdict(list)

    def wrap(owner, name: str) -> None:
        function = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}".replace("minivllm.worker.", "")

        @functools.wraps(function)
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                times[label].append(time.perf_counter() - t)

        setattr(owner, name, timed)

    warm_up = 100
    max_model_len = args.context + warm_up + args.steps + 8  # every request's tokens, and a margin
    blocks_per_req = -(-max_model_len // 16)
    num_blocks = args.batch * blocks_per_req + 16
    config = EngineConfig.create(args.model, load_format="dummy", num_gpu_blocks=num_blocks,
                                 max_model_len=max_model_len, max_num_seqs=args.batch,
                                 max_num_batched_tokens=max(256, args.batch))
    runner = model_runner.ModelRunner(config)
    runner.initialize_cache(num_blocks)
    if not args.no_instrument:
        for owner, name in TIMED:
            wrap(owner, name)
    params = SamplingParams(temperature=args.temperature, max_tokens=100_000, ignore_eos=True)
    rng = np.random.default_rng(0)
    ids = [str(i) for i in range(args.batch)]
    runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(req_id=r, prompt_token_ids=rng.integers(0, config.vocab_size, args.context + 1).tolist(),
                           output_token_ids=[], sampling_params=params, num_computed_tokens=args.context,
                           block_ids=list(range(i * blocks_per_req, (i + 1) * blocks_per_req)))
            for i, r in enumerate(ids)],
        scheduled_cached_reqs=[], num_scheduled_tokens=dict.fromkeys(ids, 1), total_num_scheduled_tokens=args.batch,
        finished_req_ids=[]))
    computed = args.context + 1
    runner.overlap_outputs = True
    wall, waited = [], 0.0
    for i in range(warm_up + args.steps):
        if i == warm_up:
            times.clear()
            waited = runner.gpu_wait_s
        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=[CachedRequestData(r, [], computed) for r in ids],
            num_scheduled_tokens=dict.fromkeys(ids, 1), total_num_scheduled_tokens=args.batch, finished_req_ids=[])
        t = time.perf_counter()
        runner.run_step(scheduler_output)
        wall.append(time.perf_counter() - t)
        computed += 1
    runner.finish_pending()
    print(f"batch {args.batch}, context ~{args.context}, temperature {args.temperature}"
          f"{'' if args.no_instrument else ' (instrumented)'}: run_step median "
          f"{np.median(wall[warm_up:]) * 1e6:.0f} us, of which waiting for the GPU's tokens "
          f"{(runner.gpu_wait_s - waited) / args.steps * 1e6:.0f} us on average")
    for label, samples in sorted(times.items(), key=lambda item: -sum(item[1])):
        print(f"  {label:36s} calls {len(samples):4d}  median {np.median(samples) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
