"""What the CPU offload tier's scheduler side does on small, tight pools (CPU, no model): the
shared-prefix rounds of tests/unit/test_kv_offload.py (9-15 requests a round over 3 prefixes, 4
rounds) driven through the real Scheduler and OffloadingConnectorScheduler by the fake worker that
moves KV fingerprints. Prints, per (GPU blocks, host blocks, requests a round), the tokens the
worker computed (fewer: more prefix reuse), the blocks copied to the host (all, and ahead of their
eviction) and the blocks loaded back.

    python benchmarks/offload_copies.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.unit.test_kv_offload import make, run_rounds  # noqa: E402

SCENARIOS = [(16, 16, 9), (16, 24, 12), (24, 16, 15), (16, 64, 9)]


def main() -> None:
    model_dir = tempfile.mkdtemp(prefix="offload-copies-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:  # one block is 32 bytes in float32
        json.dump({"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "hidden_size": 1}, f)
    print("| GPU blocks | host blocks | requests a round | tokens computed | copied out (ahead) | loaded back |")
    print("|---:|---:|---:|---:|---:|---:|")
    for gpu_blocks, host_blocks, requests in SCENARIOS:
        scheduler, worker = make(model_dir, gpu_blocks, host_blocks, load_delay=1, store_delay=1)
        run_rounds(scheduler, worker, rounds=4, n=requests)
        tier = scheduler.connector
        print(f"| {gpu_blocks} | {host_blocks} | {requests} | {worker.num_computed_tokens_total} | "
              f"{tier.num_spilled} ({tier.num_spilled_ahead}) | {tier.num_loaded_hits} |")


if __name__ == "__main__":
    main()
