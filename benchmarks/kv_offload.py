"""The CPU offload tier and swap preemption, measured (runs on CPU and GPU; prints markdown tables).

1. multi-turn: conversations whose prefixes together exceed the GPU KV cache; each turn re-sends
   the whole conversation (system prompt + earlier turns + answers) plus a new user message, and
   every conversation takes its turn before any takes the next. The prefix cache alone keeps only
   the most recent conversations; the host tier keeps the others.
   Throughput and TTFT (of turns after the first, which have a prefix to reuse), with and without
   the tier (kv_offloading_size).
2. preemption-heavy: more long-output requests than the KV cache holds, so running requests are
   preempted again and again; recompute vs swap (preemption_mode), for the fcfs and v0 policies.

    python benchmarks/kv_offload.py                      # CPU: a small random Llama built here
    python benchmarks/kv_offload.py --model DIR --device cuda --num-gpu-blocks 2000 \\
        --offload-gib 16 --conversations 48 --system-tokens 2000 --turn-tokens 200 --answer-tokens 100 \\
        --requests 128 --prompt-tokens 1000 --output-tokens 512
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time

from minivllm import LLM, SamplingParams
from minivllm.frontend.async_llm import AsyncLLM


def small_model() -> str:
    """A random Llama big enough that recomputing a prompt costs more than copying its KV."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(os.path.join(tempfile.mkdtemp(), "bench-llama"), arch="llama", hidden_size=256,
                            intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=2, max_position_embeddings=8192)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# ---------------------------------------------------------------- 1. multi-turn


async def run_conversations(llm: AsyncLLM, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    vocab = llm.engine_info.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    ttfts: list[float] = []
    out_tokens = 0

    histories = [[rng.randrange(1, vocab) for _ in range(args.system_tokens)] for _ in range(args.conversations)]
    limit = asyncio.Semaphore(args.concurrency)

    async def turn(c: int, t: int) -> None:
        nonlocal out_tokens
        async with limit:
            history = histories[c]
            history += [rng.randrange(1, vocab) for _ in range(args.turn_tokens)]
            start = time.perf_counter()
            first = None
            answer: list[int] = []
            async for output in llm.generate({"prompt_token_ids": list(history)}, params, f"c{c}-t{t}"):
                if first is None and output.outputs[0].token_ids:
                    first = time.perf_counter() - start
                answer = output.outputs[0].token_ids
            if t > 0:
                ttfts.append(first)
            out_tokens += len(answer)
            history += answer

    start = time.perf_counter()
    # Turn t of every conversation (`concurrency` at a time), then turn t + 1 of every one: by the
    # time a conversation comes back, the others' turns have pushed its prefix out of the GPU cache.
    for t in range(args.turns):
        await asyncio.gather(*(turn(c, t) for c in range(args.conversations)))
    elapsed = time.perf_counter() - start
    return {"elapsed": elapsed, "ttfts": ttfts, "out_tokens": out_tokens}


def bench_multi_turn(model: str, args: argparse.Namespace, common: dict) -> list[str]:
    rows = []
    for label, extra in (("prefix cache only", {}), (f"+ CPU tier {args.offload_gib:g} GiB",
                                                     {"kv_offloading_size": args.offload_gib})):
        llm = AsyncLLM(model, skip_tokenizer_init=True, **common, **extra)
        try:
            before = asyncio.run(_stats(llm))
            result = asyncio.run(run_conversations(llm, args))
            after = asyncio.run(_stats(llm))
        finally:
            llm.shutdown()
        ttfts = result["ttfts"]
        prefill = after.num_prefill_tokens - before.num_prefill_tokens
        rows.append(f"| {label} | {result['elapsed']:.2f} | {result['out_tokens'] / result['elapsed']:.1f} | "
                    f"{1000 * statistics.mean(ttfts):.1f} | {1000 * percentile(ttfts, 0.5):.1f} | "
                    f"{1000 * percentile(ttfts, 0.99):.1f} | {prefill} | {100 * (after.prefix_cache_hit_rate):.1f}% |")
    return ["| multi-turn | time (s) | output tok/s | TTFT mean (ms) | TTFT p50 | TTFT p99 | prefill tokens computed "
            "| GPU prefix-cache hit rate |", "|---|---|---|---|---|---|---|---|", *rows]


async def _stats(llm: AsyncLLM):
    return await llm.get_stats()


# ---------------------------------------------------------------- 2. preemption-heavy


def bench_preemption(model: str, args: argparse.Namespace, common: dict) -> list[str]:
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 200) for _ in range(args.prompt_tokens)]}
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    rows = []
    reference = None
    for policy in ("fcfs", "v0"):
        for mode in ("recompute", "swap"):
            settings = dict(common, scheduling_policy=policy, preemption_mode=mode)
            if mode == "swap":
                settings["kv_offloading_size"] = args.offload_gib
            if policy == "v0":
                settings.pop("max_num_batched_tokens", None)
            llm = LLM(model, skip_tokenizer_init=True, **settings)
            try:
                before = llm.get_stats()
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                after = llm.get_stats()
            finally:
                llm.shutdown()
            tokens = [o.outputs[0].token_ids for o in outputs]
            if reference is None:
                reference = tokens
            same = "yes" if tokens == reference else "NO"
            generated = sum(len(t) for t in tokens)
            rows.append(f"| {policy} | {mode} | {elapsed:.2f} | {generated / elapsed:.1f} | "
                        f"{after.num_preemptions - before.num_preemptions} | "
                        f"{after.num_prefill_tokens - before.num_prefill_tokens} | {same} |")
    return ["| policy | preemption | time (s) | output tok/s | preemptions | prefill tokens computed | "
            "same tokens |", "|---|---|---|---|---|---|---|", *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: a small random Llama, built here)")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights from config.json")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks", type=int, default=96, help="a GPU KV cache smaller than the workload")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--offload-gib", type=float, default=0.25)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--only", choices=("multi-turn", "preemption"), default=None)
    args = parser.parse_args()
    model = args.model or small_model()
    common = dict(device=args.device, dtype=args.dtype, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                  max_num_batched_tokens=args.max_num_batched_tokens, load_format=args.load_format,
                  max_model_len=min(8192, args.num_gpu_blocks * args.block_size))
    print(f"model {model}; GPU KV cache {args.num_gpu_blocks} blocks x {args.block_size} tokens; "
          f"host tier {args.offload_gib:g} GiB\n")
    if args.only in (None, "multi-turn"):
        print(f"{args.conversations} conversations ({args.concurrency} at a time) x {args.turns} turns: "
              f"{args.system_tokens} system + {args.turn_tokens} per turn + {args.answer_tokens}-token answers\n")
        print("\n".join(bench_multi_turn(model, args, common)), "\n", flush=True)
    if args.only in (None, "preemption"):
        print(f"{args.requests} requests x ({args.prompt_tokens} prompt + {args.output_tokens} output) tokens\n")
        print("\n".join(bench_preemption(model, args, common)), flush=True)


if __name__ == "__main__":
    main()
