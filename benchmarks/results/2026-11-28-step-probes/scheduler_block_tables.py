"""The 256-request workload through the Scheduler alone (no model), as bench runs it: 8 warm-up
requests, a prefix-cache reset, then 256 prompts of 100-1,024 tokens and 256 output tokens each.
Prints how many of a sequence's neighbouring cache blocks are consecutive ids at the 130th step,
and three block tables.

    python3 benchmarks/results/2026-11-28-step-probes/scheduler_block_tables.py   # needs the test extras
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))  # for tests.unit

from minivllm.core.scheduler import Scheduler
from minivllm.protocol.messages import ModelRunnerOutput
from tests.unit.scheduler_harness import make_config, make_request

NUM_BLOCKS = 33_000  # about what an H100 holds for Qwen3-0.6B in bf16
SNAPSHOT_STEP = 130


def run_to_completion(scheduler, requests, snapshot_step=None):
    """Steps until every request is done; each scheduled request that reaches its end gets a token.
    Returns the step count and, at snapshot_step, every running request's block ids."""
    for request in requests:
        scheduler.add_request(request)
    steps, snapshot = 0, None
    while scheduler.requests:
        out = scheduler.schedule()
        finished = [rid for rid, n in out.num_scheduled_tokens.items()
                    if scheduler.requests[rid].num_computed_tokens + n >= scheduler.requests[rid].num_tokens]
        scheduler.update_from_output(out, ModelRunnerOutput(req_ids=finished, sampled_token_ids=[100] * len(finished)))
        steps += 1
        if steps == snapshot_step:
            snapshot = {rid: list(scheduler.kv_cache_manager.get_block_ids(rid)) for rid in scheduler.requests}
    return steps, snapshot


def main() -> None:
    config = make_config(block_size=16, max_num_batched_tokens=16384, max_num_seqs=256, max_model_len=4096)
    scheduler = Scheduler(config, NUM_BLOCKS)
    prompt_lens = np.random.default_rng(0).integers(100, 1025, size=256)
    warm_up = [make_request(f"w{i}", int(prompt_lens[i]), max_tokens=256, ignore_eos=True) for i in range(8)]
    run_to_completion(scheduler, warm_up)
    scheduler.reset_prefix_cache()
    measured = [make_request(f"r{i}", int(n), max_tokens=256, ignore_eos=True) for i, n in enumerate(prompt_lens)]
    steps, tables = run_to_completion(scheduler, measured, SNAPSHOT_STEP)
    consecutive = np.mean([(np.diff(t) == 1).mean() for t in tables.values()])
    print(f"{steps} steps; at step {SNAPSHOT_STEP}, {len(tables)} running; consecutive neighbours: {consecutive:.3f}")
    for table in list(tables.values())[:3]:
        print(table[:24], "...", table[-10:])


if __name__ == "__main__":
    main()
