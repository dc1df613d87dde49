"""The worker's host work per decode step, measured on the CPU: ModelRunner.run_step over N
decoding requests of a tiny random model, less the time in the model's forward and the sampler's
tensor ops (the GPU's work on a GPU). What is left (applying the SchedulerOutput, preparing the
inputs, copying them in, collecting the tokens, building the output) is the Python and numpy work
that scales with the number of requests, which the worker pays per step on a GPU host too.

    python benchmarks/worker_step_cpu.py [--batch 256] [--context 32] [--steps 300] [--temperature 1.0]
                                         [--overlap] [--buffers] [--profile | --no-instrument]

--overlap holds each step's tokens back as the worker does on CUDA (the next step's input ids
patched from the previous step's sampled ids, its tokens collected after the next forward);
--buffers loads every step into StepBuffers' packed buffer as on CUDA (an eager step's copy). The
two together run the CUDA decode path's host code, but for the graphs and the fused sampler.
Reports the host work's median and spread, then each named stage's median per call (perf_counter
wrappers, which add a little; --no-instrument leaves them out). --profile prints cProfile's view.
The requests' contexts differ by up to 15 tokens, so each step a sixteenth of them get a new block
as the scheduler would send it. A CPU forward leaves the caches cold, so numpy calls read slower
here than in a loop of their own.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import json
import os
import pstats
import tempfile
import time

import numpy as np
import torch

import minivllm.worker.input_batch as input_batch
import minivllm.worker.model_runner as model_runner
import minivllm.worker.sampler as sampler
import minivllm.worker.step_buffers as step_buffers
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.worker.cuda_graphs import max_step_tokens

BLOCK_SIZE = 16
# The model's forward and the sampler's tensor ops (and the LM head, once the model's class is
# known): compute here, the GPU's work on a GPU.
COMPUTE = [(model_runner.ModelRunner, "_forward"), (sampler.Sampler, "__call__")]
TIMED = [(model_runner.ModelRunner, "_update_states"), (input_batch.InputBatch, "prepare"),
         (step_buffers.StepBuffers, "load"), (model_runner.ModelRunner, "_patch_pending_inputs"),
         (model_runner.ModelRunner, "_sample"), (model_runner.ModelRunner, "finish_pending"),
         (input_batch.InputBatch, "resolve_pending"), (input_batch.InputBatch, "append_pending"),
         (input_batch.InputBatch, "append_sampled")]

# As small as the model code allows (the host work does not depend on the model's size): one
# layer, a 128-token vocabulary.
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 128, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000, "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 0,
    "eos_token_id": 0, "torch_dtype": "float32",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=32, help="prompt tokens (plus 0-15 per request)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--overlap", action="store_true", help="hold each step's tokens back, as on CUDA")
    parser.add_argument("--buffers", action="store_true", help="load each step into StepBuffers, as on CUDA")
    parser.add_argument("--profile", action="store_true", help="cProfile the measured steps")
    parser.add_argument("--no-instrument", action="store_true", help="time no stages of the step")
    args = parser.parse_args()
    os.environ[model_runner.OVERLAP_ENV] = "1" if args.overlap else "0"
    torch.set_num_threads(1)  # the forward's threads would only add noise

    times: dict[str, list[float]] = collections.defaultdict(list)
    compute_s = 0.0  # the current step's time in COMPUTE

    def wrap(owner, name: str, compute: bool = False) -> None:
        function = getattr(owner, name)

        @functools.wraps(function)
        def timed(*a, **k):
            nonlocal compute_s
            t = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                seconds = time.perf_counter() - t
                times[f"{owner.__name__}.{name}"].append(seconds)
                compute_s += seconds if compute else 0.0

        setattr(owner, name, timed)

    warm_up = 50
    max_model_len = args.context + BLOCK_SIZE + warm_up + args.steps
    blocks_per_req = -(-max_model_len // BLOCK_SIZE)
    num_blocks = args.batch * blocks_per_req
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(TINY_QWEN3, f)
        config = EngineConfig.create(model_dir, load_format="dummy", device="cpu", block_size=BLOCK_SIZE,
                                     num_gpu_blocks=num_blocks, max_model_len=max_model_len,
                                     max_num_seqs=args.batch,
                                     max_num_batched_tokens=args.batch * (args.context + BLOCK_SIZE))
        runner = model_runner.ModelRunner(config)
    runner.initialize_cache(num_blocks)
    if args.buffers:
        runner.buffers = step_buffers.StepBuffers(max_step_tokens(config), config.max_num_seqs,
                                                  runner.input_batch.max_blocks_per_req, runner.device)
        runner.buffers.kv_layout = runner.kv_layout
    for owner, name in COMPUTE + [(type(runner.model), "compute_logits")]:
        wrap(owner, name, compute=True)
    if not (args.profile or args.no_instrument):
        for owner, name in TIMED:
            wrap(owner, name)

    # The prompts in one step, then one token per request per step; request i's blocks are
    # i * blocks_per_req onwards, each sent when its first token is about to run.
    params = SamplingParams(temperature=args.temperature, max_tokens=100_000, ignore_eos=True)
    rng = np.random.default_rng(0)
    ids = [f"req-{i}" for i in range(args.batch)]
    prompt_lens = [args.context + i % BLOCK_SIZE for i in range(args.batch)]
    num_req_blocks = [-(-(n + 1) // BLOCK_SIZE) for n in prompt_lens]  # the prompt and the first sampled token
    runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(req_id=r, prompt_token_ids=rng.integers(0, config.vocab_size, n).tolist(),
                           output_token_ids=[], sampling_params=params, num_computed_tokens=0,
                           block_ids=list(range(i * blocks_per_req, i * blocks_per_req + num_req_blocks[i])))
            for i, (r, n) in enumerate(zip(ids, prompt_lens))],
        scheduled_cached_reqs=[], num_scheduled_tokens=dict(zip(ids, prompt_lens)),
        total_num_scheduled_tokens=sum(prompt_lens), finished_req_ids=[]))
    computed = list(prompt_lens)
    wall: list[float] = []
    host: list[float] = []
    profiler = cProfile.Profile()
    for step in range(warm_up + args.steps):
        if step == warm_up:
            times.clear()
            if args.profile:
                profiler.enable()
        cached_reqs = []
        for i, r in enumerate(ids):
            new_block_ids = []
            if computed[i] + 1 > num_req_blocks[i] * BLOCK_SIZE:  # this step's token starts a block
                new_block_ids = [i * blocks_per_req + num_req_blocks[i]]
                num_req_blocks[i] += 1
            cached_reqs.append(CachedRequestData(r, new_block_ids, computed[i]))
            computed[i] += 1
        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=cached_reqs, num_scheduled_tokens=dict.fromkeys(ids, 1),
            total_num_scheduled_tokens=args.batch, finished_req_ids=[])
        compute_s = 0.0
        t = time.perf_counter()
        runner.run_step(scheduler_output)
        wall.append(time.perf_counter() - t)
        host.append(wall[-1] - compute_s)
    profiler.disable()
    runner.finish_pending()

    host_us = np.array(host[warm_up:]) * 1e6
    print(f"batch {args.batch}, context ~{args.context}, temperature {args.temperature}, "
          f"{'overlapped' if args.overlap else 'synchronous'}{', StepBuffers' if args.buffers else ''}"
          f"{'' if args.profile or args.no_instrument else ' (instrumented)'}: host work per step median "
          f"{np.median(host_us):.0f} us (p10-p90 {np.percentile(host_us, 10):.0f}-{np.percentile(host_us, 90):.0f}) "
          f"of run_step's {np.median(wall[warm_up:]) * 1e6:.0f} us")
    if args.profile:
        stats = pstats.Stats(profiler).sort_stats("tottime")
        stats.print_stats(25)
        stats.print_callees("run_step|_sample|finish_pending|prepare|_update_states|_run_model|load")
    for label, samples in sorted(times.items(), key=lambda item: -sum(item[1])):
        print(f"  {label:34s} calls {len(samples):4d}  median {np.median(samples) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
