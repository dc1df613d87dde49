"""Where a step's time goes, on the GPU: the worker's ModelRunner driven in-process.

Fills a persistent batch with N decoding requests whose contexts are already "cached" (random
K/V), then times decode steps (CUDA graph replay + logits + sampling + the host work around it),
the attention kernel alone, and one full-budget prefill step; finally a torch.profiler table of
the decode step's kernels. Usage (on the device machine):

    python3 benchmarks/profile_step.py --model benchmarks/configs/qwen3-0.6b --batch 256 --context 700
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.worker.model_runner import ModelRunner


def cuda_time_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-prefill", action="store_true", help="skip the full-budget prefill step")
    parser.add_argument("--prompt-len", type=int, default=0,
                        help="the prefill step's prompts are this long (default: one prompt fills the budget)")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="profile the prefill forward's kernels instead of the decode step's")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--host", action="store_true",
                        help="also run steps as the worker does (outputs held back, the next step launched before "
                             "the previous one's tokens are read) and profile that loop's host time")
    args = parser.parse_args()
    if args.profile_prefill and args.no_prefill:
        parser.error("--profile-prefill needs the prefill step (drop --no-prefill)")

    block_size = 16
    # every step writes a slot: the timed ones, --host's (twice as many, then 20 profiled), 5 profiled
    steps_run = args.steps * (3 if args.host else 1) + 40
    blocks_per_req = -(-(args.context + steps_run) // block_size)
    # (the prefill step writes slots 0..max_num_batched_tokens - 1)
    num_blocks = max(args.batch * blocks_per_req, 2 * -(-args.max_num_batched_tokens // block_size)) + 64
    max_model_len = max(4096, args.max_num_batched_tokens)
    config = EngineConfig.create(args.model, load_format="dummy", num_gpu_blocks=num_blocks, max_model_len=max_model_len,
                                 max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens,
                                 enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype)
    runner = ModelRunner(config)
    t0 = time.perf_counter()
    runner.initialize_cache(num_blocks)
    print(f"initialize_cache (+ graph capture): {time.perf_counter() - t0:.1f} s")
    for cache in runner.kv_caches:  # random K/V (never zeros: they can run faster than real data)
        views = runner.kv_layout.split(cache)
        for data, scales in ((views.key, views.key_scale), (views.value, views.value_scale)):
            data.copy_(torch.randn(data.shape, device=data.device).to(data.dtype))
            if scales is not None:
                scales.uniform_(0.01, 0.02)
    params = SamplingParams(temperature=args.temperature, max_tokens=10_000, ignore_eos=True)
    rng = np.random.default_rng(0)
    new_reqs = []
    for i in range(args.batch):
        prompt = rng.integers(0, 150_000, size=args.context + 1).tolist()
        new_reqs.append(NewRequestData(req_id=str(i), prompt_token_ids=prompt, output_token_ids=[],
                                       sampling_params=params,
                                       block_ids=list(range(i * blocks_per_req, (i + 1) * blocks_per_req)),
                                       num_computed_tokens=args.context))
    first = SchedulerOutput(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=[],
                            num_scheduled_tokens={str(i): 1 for i in range(args.batch)},
                            total_num_scheduled_tokens=args.batch, finished_req_ids=[])
    runner.execute_model(first)
    computed = [args.context + 1] * args.batch

    def decode_output() -> SchedulerOutput:
        return SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=[CachedRequestData(str(i), [], computed[i]) for i in range(args.batch)],
            num_scheduled_tokens={str(i): 1 for i in range(args.batch)},
            total_num_scheduled_tokens=args.batch, finished_req_ids=[])

    def timed_steps(run_step, num_steps: int) -> float:
        """Median wall time (ms) of `run_step(scheduler_output)` over num_steps decode steps."""
        nonlocal computed
        torch.cuda.synchronize()
        wall = []
        for _ in range(num_steps):
            so = decode_output()
            t = time.perf_counter()
            run_step(so)
            wall.append(time.perf_counter() - t)
            computed = [c + 1 for c in computed]
        return 1000 * float(np.median(wall))

    # (Every step adds a key to each sequence: each figure below names the keys its steps attended.)
    keys_from = computed[0] + 1
    step_ms = timed_steps(runner.execute_model, args.steps)
    print(f"decode step, batch {args.batch}, {keys_from}-{computed[0]} keys: execute_model {step_ms:.2f} ms "
          f"-> {args.batch / step_ms * 1000:.0f} tok/s")

    if args.host:
        # As the worker runs them: run_step holds a step's tokens back and hands them on after
        # launching the next step, so the host may run up to a step ahead of the GPU.
        runner.overlap_outputs = True
        loop_ms = timed_steps(runner.run_step, args.steps)
        gpu_wait_before = runner.gpu_wait_s
        from torch.profiler import ProfilerActivity, profile

        profiled_steps = 20
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(profiled_steps):
                runner.run_step(decode_output())
                computed = [c + 1 for c in computed]
            loop_s = time.perf_counter() - t
        runner.finish_pending()
        torch.cuda.synchronize()
        per_step_ms = lambda seconds: 1000 * seconds / profiled_steps  # noqa: E731
        print(f"worker loop (overlapped run_step): median {loop_ms:.3f} ms per step; "
              f"profiled: {per_step_ms(loop_s):.3f} ms per step, of which waiting for the GPU's tokens "
              f"{per_step_ms(runner.gpu_wait_s - gpu_wait_before):.3f} ms")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))

    # The pieces.
    step = runner.input_batch.prepare(decode_output().num_scheduled_tokens)
    runner.input_batch.num_computed_tokens[:] -= 1  # undo prepare's bookkeeping
    t = time.perf_counter()
    for _ in range(100):
        runner.input_batch.prepare(decode_output().num_scheduled_tokens)
        runner.input_batch.num_computed_tokens[: args.batch] -= 1
    print(f"  host prepare (incl. building the SchedulerOutput): {(time.perf_counter() - t) * 10:.3f} ms")
    if runner.graphs is not None:
        print(f"  graph replay (forward): {cuda_time_ms(lambda: runner.graphs.run(step)):.2f} ms")
    metadata = runner.buffers.load(step)
    model = runner.model
    hidden = torch.randn(args.batch, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    print(f"  compute_logits: {cuda_time_ms(lambda: model.compute_logits(hidden)):.2f} ms")
    logits = model.compute_logits(hidden)
    rows = np.arange(args.batch)
    from minivllm.worker.sampler import SamplingMetadata

    b = runner.input_batch
    sm = SamplingMetadata.from_arrays(b.temperature[rows], b.top_k[rows], b.top_p[rows], [None] * args.batch, "cuda")
    print(f"  torch sampler (temperature {args.temperature}): {cuda_time_ms(lambda: runner.sampler(logits, sm)):.2f} ms")
    seeds = np.arange(args.batch)
    fused = lambda: runner.sampler.sample_rows(logits, b.temperature[rows], b.top_k[rows], b.top_p[rows],  # noqa: E731
                                               [None] * args.batch, seeds, b.min_p[rows])
    print(f"  fused sampler (temperature {args.temperature}): {cuda_time_ms(fused):.2f} ms")
    attn = model.model.layers[0].self_attn
    from minivllm.worker.attention.triton_attention import paged_attention

    q = torch.randn(args.batch, attn.num_heads, attn.head_dim, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: paged_attention(q, runner.kv_caches[0], metadata, attn.scale))
    layout = runner.kv_layout
    keys = computed[0] + 1  # the step prepared above
    kv_bytes = args.batch * keys * 2 * layout.block_bytes // layout.block_size
    # Timed eagerly, one launch at a time: on an H100 this read ~360 us (~2.0 TB/s) for 256 x 700,
    # where benchmarks/read_ceilings.py times the same kernel in a CUDA graph at ~2.98 TB/s.
    print(f"  attention kernel, one layer, eager, {keys} keys: {ms * 1000:.1f} us, "
          f"{kv_bytes / ms / 1e6:.0f} GB/s of KV (x{model.num_layers} layers = {ms * model.num_layers:.2f} ms)")

    # A full-budget prefill step (fresh requests, whole prompts of --prompt-len tokens, or one).
    if not args.no_prefill:
        n = args.max_num_batched_tokens
        from minivllm.worker.input_batch import StepInputs

        prompt_len = min(args.prompt_len or n, n)
        query_lens = np.full(n // prompt_len, prompt_len)
        if n % prompt_len:
            query_lens = np.append(query_lens, n % prompt_len)
        num_prompts = len(query_lens)
        if num_prompts > args.batch:  # a step holds at most max_num_seqs (= --batch) sequences
            raise SystemExit(f"--prompt-len {prompt_len}: {num_prompts} prompts fill the budget, more than --batch "
                             f"{args.batch} sequences a step may hold")
        query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
        blocks_per_prompt = -(-prompt_len // block_size)
        block_table = np.arange(num_prompts * blocks_per_prompt, dtype=np.int32).reshape(num_prompts, -1)
        positions = np.arange(n) - np.repeat(query_start_loc[:-1], query_lens)
        slots = block_table[np.repeat(np.arange(num_prompts), query_lens), positions // block_size] * block_size \
            + positions % block_size
        pre = StepInputs(req_ids=[f"p{i}" for i in range(num_prompts)], input_ids=np.zeros(n, dtype=np.int64),
                         positions=positions, slot_mapping=slots, block_table=block_table,
                         logits_indices=query_start_loc[1:] - 1, sampling_req_index=np.arange(num_prompts),
                         sampling_rows=np.arange(num_prompts), query_start_loc=query_start_loc, seq_lens=query_lens,
                         max_query_len=int(query_lens.max()), max_seq_len=int(query_lens.max()))

        def eager_prefill() -> None:  # (loaded each time: a graph's replay loads its own padded layout)
            metadata = runner.buffers.load(pre)
            runner._forward(*runner.buffers.forward_inputs, metadata)

        what = f"{n} tokens in {num_prompts} prompt(s)"
        print(f"  prefill forward, {what}, eager: {cuda_time_ms(eager_prefill, 5):.2f} ms")
        graphed = runner.graphs is not None and runner.graphs.run(pre) is not None
        if graphed:
            print(f"  prefill forward, {what}, graph: {cuda_time_ms(lambda: runner.graphs.run(pre), 5):.2f} ms")

    from torch.profiler import ProfilerActivity, profile

    if not args.profile_prefill:
        print(f"profiled: 5 decode steps of {computed[0] + 1}-{computed[0] + 5} keys a sequence")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            if args.profile_prefill and graphed:  # as the engine runs it: padded
                runner.graphs.run(pre)
            elif args.profile_prefill:
                eager_prefill()
            else:
                runner.execute_model(decode_output())
                computed = [c + 1 for c in computed]
        torch.cuda.synchronize()
    # With PDL (the default on Hopper) a kernel starts before the one ahead has finished and waits
    # inside: its span here includes that wait, so the kernels' sum exceeds the step's time (the
    # Hopper GEMM read 2-3x its time alone). The graph replay above is the step's time.
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
