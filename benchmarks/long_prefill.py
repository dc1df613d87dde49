"""Time to first token for one long prompt, against an HF forward with SDPA on the same shape (GPU).

    python benchmarks/long_prefill.py --model benchmarks/configs/qwen3-0.6b --input-lens 16384,32000 \
        --budgets 8192,32768 [--recycled-blocks | --busy-pool] [--block-size 16] [--fresh-prompts] [--json FILE]

For each budget (max_num_batched_tokens) one engine serves the prompt of each length (dummy bf16
weights, greedy, one output token, prefix cache reset before each run; median of --iters). The HF
row is one forward of the same tokens through transformers with attn_implementation="sdpa",
keeping only the last position's logits. Each row also gives the whole prefill's FLOP rate:
2 FLOPs per weight per token through the projections (the LM head for one token), plus causal
attention, 4 * heads * head_dim FLOPs per layer per visible (query, key) pair; and its share of
the bf16 matmul rate measured on this GPU. --recycled-blocks runs each prompt in blocks that earlier
ones freed, as a pool that has served a while hands them out, instead of a fresh pool's ascending ids.
--busy-pool runs each in blocks that 64 decoding requests took one at a time, side by side, and
freed: scattered, as in a busy server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


BUSY_REQUESTS = 64


def prefill_flops(shape, vocab_hidden: int, num_tokens: int) -> float:
    projections = 2.0 * (shape.matmul_params - vocab_hidden) * num_tokens + 2.0 * vocab_hidden
    attention = 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * num_tokens * (num_tokens + 1) / 2
    return projections + attention


def time_minivllm(model: str, input_lens: list[int], budget: int, iters: int, kv_cache_dtype: str = "auto",
                  recycled_blocks: bool = False, busy_pool: bool = False,
                  block_size: int = 16, fresh_prompts: bool = False) -> dict[int, list[float]]:
    from minivllm import LLM, SamplingParams

    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    times: dict[int, list[float]] = {}
    max_model_len = max(input_lens) + 16
    # A pool a little over the longest prompt's blocks, filled once before timing: every timed
    # prompt then runs in blocks an earlier one freed, handed back last first (runs of descending
    # ids, then ascending again after the next round), as a pool that has served a while hands them.
    # A busy pool: BUSY_REQUESTS requests decode side by side through nearly the whole pool, each
    # taking a block every block_size steps in turn, so a request's blocks are ids BUSY_REQUESTS apart;
    # they finish at different steps and free theirs, which the timed prompts then take: scattered.
    # The fill runs again before each timed run (a run's own blocks come back in runs).
    num_gpu_blocks = -(-max_model_len // block_size) + 64 if recycled_blocks or busy_pool else None
    with LLM(model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, block_size=block_size,
             max_model_len=max_model_len, max_num_batched_tokens=budget, kv_cache_dtype=kv_cache_dtype,
             num_gpu_blocks=num_gpu_blocks) as llm:

        def random_prompt(num_tokens: int) -> dict:
            return {"prompt_token_ids": torch.randint(0, 32000, (num_tokens,), generator=gen).tolist()}

        def fill() -> None:
            if recycled_blocks:
                llm.generate(random_prompt(max(input_lens)), first, use_tqdm=False)
            if busy_pool:
                tokens_each = num_gpu_blocks * block_size // BUSY_REQUESTS - block_size  # all of them fit at once
                lengths = torch.randint(tokens_each * 4 // 5, tokens_each, (BUSY_REQUESTS,), generator=gen).tolist()
                llm.generate([{"prompt_token_ids": [1 + i] * 4} for i in range(BUSY_REQUESTS)],
                             [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths],
                             use_tqdm=False)

        fill()
        for n in input_lens:
            prompt = random_prompt(n)
            llm.generate(prompt, first, use_tqdm=False)  # warm-up: compiles this shape's kernels
            times[n] = []
            for _ in range(iters):
                if busy_pool:
                    fill()
                if fresh_prompts:
                    prompt = random_prompt(n)
                llm.reset_prefix_cache()
                start = time.perf_counter()
                llm.generate(prompt, first, use_tqdm=False)
                times[n].append(time.perf_counter() - start)
    return times


def time_hf(model: str, input_lens: list[int], iters: int) -> dict[int, list[float]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    times: dict[int, list[float]] = {}
    with torch.inference_mode():
        for n in input_lens:
            ids = torch.randint(0, 32000, (1, n), device="cuda")
            hf(ids, logits_to_keep=1)
            times[n] = []
            for _ in range(iters):
                torch.cuda.synchronize()
                start = time.perf_counter()
                hf(ids, logits_to_keep=1)
                torch.cuda.synchronize()
                times[n].append(time.perf_counter() - start)
    del hf
    torch.cuda.empty_cache()
    return times


def main() -> None:
    from minivllm.frontend.roofline import ModelShape, measure_ceilings
    from transformers import AutoConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    parser.add_argument("--input-lens", default="16384,32000")
    parser.add_argument("--budgets", default="8192,32768", help="max_num_batched_tokens values to run")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--recycled-blocks", action="store_true",
                        help="a pool just over the longest prompt, filled once before timing: the timed prompts get "
                             "blocks earlier ones freed (descending and ascending runs) instead of a fresh pool's")
    parser.add_argument("--busy-pool", action="store_true",
                        help="a pool just over the longest prompt, through which 64 decoding requests ran before each "
                             "timed prompt: its blocks come scattered, as in a busy server")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--fresh-prompts", action="store_true",
                        help="a new random prompt each timed run, as a new document is: by default each length's one "
                             "prompt repeats, so the engine takes its block hashes over from the run before")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.recycled_blocks and args.busy_pool:
        parser.error("--recycled-blocks and --busy-pool are two ways to fill the pool: pick one")
    input_lens = [int(x) for x in args.input_lens.split(",")]
    config = AutoConfig.from_pretrained(args.model)
    shape = ModelShape.from_model_dir(args.model, dtype_bytes=2)
    vocab_hidden = config.vocab_size * config.hidden_size
    peak = measure_ceilings("cuda", "bfloat16").matmul_flops_per_s

    rows = []
    cache = ("" if args.kv_cache_dtype == "auto" else f", {args.kv_cache_dtype}") + (
        ", recycled" if args.recycled_blocks else "") + (", busy" if args.busy_pool else "") + (
        f", blocks of {args.block_size}" if args.block_size != 16 else "") + (", fresh" if args.fresh_prompts else "")
    runs = {f"minivllm, budget {b}{cache}": time_minivllm(args.model, input_lens, int(b), args.iters, args.kv_cache_dtype,
                                                                args.recycled_blocks, args.busy_pool, args.block_size,
                                                                args.fresh_prompts)
            for b in args.budgets.split(",")}
    if not args.no_hf:
        runs["HF forward, SDPA"] = time_hf(args.model, input_lens, args.iters)
    print(f"{torch.cuda.get_device_name()}: bf16 matmul rate measured {peak / 1e12:.0f} TFLOP/s")
    print(f"{'run':<48} {'input':>7} {'TTFT ms':>9} {'TFLOP/s':>8} {'% peak':>7}")
    for name, times in runs.items():
        for n, ts in times.items():
            seconds = statistics.median(ts)
            rate = prefill_flops(shape, vocab_hidden, n) / seconds
            rows.append({"run": name, "input_len": n, "ttft_ms": seconds * 1000, "times_ms": [t * 1000 for t in ts],
                         "tflops": rate / 1e12, "share_of_peak": rate / peak})
            print(f"{name:<48} {n:>7} {seconds * 1000:>9.1f} {rate / 1e12:>8.0f} {100 * rate / peak:>6.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "matmul_tflops": peak / 1e12, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
