"""How a long prompt's cache blocks lie in a pool that has served a while, for the Hopper prefill
kernel: it copies a 128-key tile with TMA where the tile's blocks are a run of consecutive ids
(in any order, on the tiles the causal mask leaves whole) and gathers every other tile. The real
Scheduler and KV cache manager, no model, no device (torch is imported, for the kernel's routing
rule, but nothing runs on it).

    python benchmarks/block_runs.py [--blocks 8192] [--steps 6000] [--sorted]

Short requests (prompts of 100-1,024 tokens, 32-256 output tokens) arrive to keep about
--running of them going, so their decode blocks are handed out one at a time, interleaved; every
--long-every steps a prompt of 16k-32k tokens arrives. Each long prompt's block table is looked at
once its prefill is done: the share of its whole tiles whose blocks are consecutive ids in order
(what the kernel took by TMA before 2026-11-26's third session) and in any order (what it takes
now), and how many prompts the routing sends to the kernel (a quarter of the tiles or more).
--sorted sorts each allocation's blocks by id.
"""

from __future__ import annotations

import argparse
import random
import statistics

import numpy as np
from minivllm.core.block_pool import BlockPool
from minivllm.core.scheduler import Scheduler
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import EngineCoreRequest, ModelRunnerOutput
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.worker.attention import hopper_prefill

BLOCK_SIZE = 16


def tile_shares(block_ids: list[int], num_tokens: int) -> tuple[float, float]:
    """Of the whole 128-key tiles: the share in order, and the share that are runs in any order."""
    per_tile = hopper_prefill.TILE_ROWS // BLOCK_SIZE
    tiles = num_tokens // hopper_prefill.TILE_ROWS
    groups = np.array(block_ids[: tiles * per_tile], dtype=np.int64).reshape(tiles, per_tile)
    in_order = float((np.diff(groups, axis=1) == 1).all(axis=1).mean())
    return in_order, hopper_prefill.tma_share(groups.reshape(1, -1), np.array([num_tokens]), BLOCK_SIZE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8192, help="GPU blocks of 16 slots")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--running", type=int, default=96, help="short requests kept going")
    parser.add_argument("--long-every", type=int, default=150, help="steps between long prompts")
    parser.add_argument("--sorted", action="store_true", help="sort each allocation's blocks by id")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.sorted:
        unsorted = BlockPool.get_new_blocks
        BlockPool.get_new_blocks = lambda self, n: sorted(unsorted(self, n), key=lambda block: block.block_id)

    rng = random.Random(args.seed)
    config = EngineConfig(model="none", tokenizer="none", max_model_len=33000, vocab_size=32000, eos_token_ids=[2],
                          block_size=BLOCK_SIZE, max_num_seqs=256, max_num_batched_tokens=8192)
    scheduler = Scheduler(config, args.blocks)
    long_ids: set[str] = set()
    looked_at: dict[str, tuple[float, float]] = {}
    ids = iter(range(10**9))

    def add(num_prompt: int, max_tokens: int, long: bool) -> None:
        request_id = f"{'long' if long else 'short'}-{next(ids)}"
        base = rng.randrange(10, 20000)
        scheduler.add_request(EngineCoreRequest(
            request_id=request_id, prompt_token_ids=[base + j % 10000 for j in range(num_prompt)],
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0,
            eos_token_ids=[2]))
        if long:
            long_ids.add(request_id)

    for step in range(args.steps):
        num_short = sum(1 for r in scheduler.requests if r.startswith("short"))
        for _ in range(max(0, args.running - num_short)):
            add(rng.randrange(100, 1025), rng.randrange(32, 257), long=False)
        if step % args.long_every == args.long_every - 1:
            add(rng.randrange(16384, 32001), 4, long=True)
        out = scheduler.schedule()
        sampled = []
        for request_id in out.num_scheduled_tokens:
            request = scheduler.requests[request_id]
            if request.num_computed_tokens >= request.num_tokens:
                sampled.append(request_id)
                if request_id in long_ids and request_id not in looked_at:  # its prefill is done
                    looked_at[request_id] = tile_shares(scheduler.kv_cache_manager.get_block_ids(request_id),
                                                        request.num_prompt_tokens)
        scheduler.update_from_output(out, ModelRunnerOutput(req_ids=sampled, sampled_token_ids=[7] * len(sampled)))

    in_order = [s[0] for s in looked_at.values()]
    any_order = [s[1] for s in looked_at.values()]
    taken = sum(share >= hopper_prefill.MIN_TMA_SHARE for share in any_order)
    taken_in_order = sum(share >= hopper_prefill.MIN_TMA_SHARE for share in in_order)
    print(f"{'sorted' if args.sorted else 'as queued'} allocations, {args.blocks} blocks, {len(looked_at)} long prompts "
          f"after {args.steps} steps: tiles in order {statistics.mean(in_order):.2f} (min {min(in_order):.2f}), "
          f"runs in any order {statistics.mean(any_order):.2f} (min {min(any_order):.2f}); "
          f"{taken} of {len(any_order)} prompts routed to the kernel ({taken_in_order} counting tiles in order only)")


if __name__ == "__main__":
    main()
