"""Ray against mp, and data-parallel scaling, with `minivllm bench throughput` (dummy weights).

    python benchmarks/ray_vs_mp.py [--model benchmarks/configs/qwen3-0.6b] [--json-dir DIR] [--only NAME,...]

Runs, one engine at a time, on the Qwen3-0.6B shape (the same random workload for all):
  tp2-mp   tensor_parallel_size=2, distributed_executor_backend=mp
  tp2-ray  tensor_parallel_size=2, distributed_executor_backend=ray (target: within 3% of tp2-mp)
  dp1      one engine on one GPU
  dp2-mp   data_parallel_size=2 (two engine cores, a GPU each), mp (target: >= 1.9x dp1)
  dp2-ray  data_parallel_size=2 under ray
and prints output tokens/s with the ratios. Needs two CUDA devices (skips cleanly otherwise); the
ray rows need Ray (benchmarks/ray_wheel.sh carries it to a machine without it).
"""

from __future__ import annotations

import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput_runs  # noqa: E402

RUNS = {
    "tp2-mp": ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"],
    "tp2-ray": ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"],
    "dp1": [],
    "dp2-mp": ["--data-parallel-size", "2", "--distributed-executor-backend", "mp"],
    "dp2-ray": ["--data-parallel-size", "2", "--distributed-executor-backend", "ray"],
}


def main() -> int:
    args = throughput_runs.parse_args(__doc__, "qwen3-0.6b", RUNS, "/tmp/ray_vs_mp")
    if not throughput_runs.have_two_gpus():
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if importlib.util.find_spec("ray") is None and any("ray" in n for n in names):
        print("ray is not installed: the ray rows are skipped (see benchmarks/ray_wheel.sh)")
        names = [n for n in names if "ray" not in n]
    os.makedirs(args.json_dir, exist_ok=True)
    # DP rows get twice the prompts: each core must see the single engine's batch to be compared fairly.
    results = {name: throughput_runs.run(name, RUNS[name], args, args.num_prompts * (2 if name.startswith("dp2") else 1))
               for name in names}
    tok_s = throughput_runs.report(results, args.json_dir)
    if "tp2-mp" in tok_s and "tp2-ray" in tok_s:
        print(f"tp2: ray / mp = {tok_s['tp2-ray'] / tok_s['tp2-mp']:.3f} (target >= 0.97)")
    for dp2 in ("dp2-mp", "dp2-ray"):
        if "dp1" in tok_s and dp2 in tok_s:
            print(f"{dp2} / dp1 = {tok_s[dp2] / tok_s['dp1']:.2f}x (target >= 1.9x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
