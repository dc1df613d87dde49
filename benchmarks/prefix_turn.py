"""Time to first token of a new turn after a long cached prefix (a long chat's next message).

    python benchmarks/prefix_turn.py --model benchmarks/configs/qwen3-0.6b --load-format dummy \
        --prefix-lens 2048,16384 --new-lens 128,256

For each prefix length P and new length N: a request of P random tokens runs first (its full
blocks stay in the prefix cache), then a request of those P tokens followed by N new ones is timed,
max_tokens=1, so the step computes only the N (checked: the output's num_cached_tokens). The median
over --iters turns (each with a prefix of its own) is printed beside a fresh prompt of N tokens,
whose difference is what the cached prefix costs: attention over it, and the host's work on a
P-token request (hashing its blocks, carrying its token ids through the processes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minivllm.frontend.llm import LLM  # noqa: E402
from minivllm.protocol.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--prefix-lens", default="2048,16384")
    parser.add_argument("--new-lens", default="128,256")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--distributed-executor-backend", default="mp")
    args = parser.parse_args()
    prefix_lens = [int(n) for n in args.prefix_lens.split(",")]
    new_lens = [int(n) for n in args.new_lens.split(",")]
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    rng = np.random.default_rng(0)
    with LLM(args.model, skip_tokenizer_init=True, load_format=args.load_format, max_model_len=args.max_model_len,
             distributed_executor_backend=args.distributed_executor_backend) as llm:
        vocab = llm.engine_info.vocab_size

        def tokens(n: int) -> list[int]:
            return rng.integers(10, vocab - 10, n).tolist()

        def first_token_ms(prompt: list[int]) -> tuple[float, int]:
            start = time.perf_counter()
            [output] = llm.generate([{"prompt_token_ids": prompt}], one_token, use_tqdm=False)
            return (time.perf_counter() - start) * 1e3, output.num_cached_tokens

        llm.generate([{"prompt_token_ids": tokens(64)}], one_token, use_tqdm=False)  # warm-up
        for new in new_lens:
            fresh = statistics.median(first_token_ms(tokens(new))[0] for _ in range(args.iters))
            print(f"fresh prompt of {new} tokens: first token {fresh:.2f} ms", flush=True)
            for prefix_len in prefix_lens:
                times = []
                for _ in range(args.iters):
                    prefix = tokens(prefix_len)
                    llm.generate([{"prompt_token_ids": prefix}], one_token, use_tqdm=False)  # cached after
                    elapsed, cached = first_token_ms(prefix + tokens(new))
                    if cached < prefix_len - llm.engine_info.block_size:
                        raise RuntimeError(f"the prefix was not served from the cache ({cached} of {prefix_len} "
                                           "tokens): is prefix caching on, and does the cache hold it?")
                    times.append(elapsed)
                print(f"  after {prefix_len} cached tokens: first token {statistics.median(times):.2f} ms "
                      f"(+{statistics.median(times) - fresh:.2f})", flush=True)


if __name__ == "__main__":
    main()
