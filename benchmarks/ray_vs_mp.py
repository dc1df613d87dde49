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

import argparse
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = ["--load-format", "dummy", "--input-len", "100:1024", "--output-len", "256", "--seed", "0",
            "--no-roofline"]
RUNS = {
    "tp2-mp": ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"],
    "tp2-ray": ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"],
    "dp1": [],
    "dp2-mp": ["--data-parallel-size", "2", "--distributed-executor-backend", "mp"],
    "dp2-ray": ["--data-parallel-size", "2", "--distributed-executor-backend", "ray"],
}


def run(name: str, args: argparse.Namespace) -> dict:
    path = os.path.join(args.json_dir, f"{name}.json")
    # DP rows get twice the prompts: each core must see the single engine's batch to be compared fairly.
    num_prompts = args.num_prompts * (2 if name.startswith("dp2") else 1)
    command = [sys.executable, os.path.join(ROOT, "bin", "minivllm"), "bench", "throughput", "--model", args.model,
               "--num-prompts", str(num_prompts), *WORKLOAD, *RUNS[name], "--json", path]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    with open(path) as f:
        return json.load(f)["results"][0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.join(ROOT, "benchmarks", "configs", "qwen3-0.6b"))
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--json-dir", default=os.environ.get("OUT", "/tmp/ray_vs_mp"))
    parser.add_argument("--only", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    args = parser.parse_args()
    import torch

    if torch.cuda.device_count() < 2:
        print(f"skipped: needs 2 CUDA devices, found {torch.cuda.device_count()}")
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if importlib.util.find_spec("ray") is None and any("ray" in n for n in names):
        print("ray is not installed: the ray rows are skipped (see benchmarks/ray_wheel.sh)")
        names = [n for n in names if "ray" not in n]
    os.makedirs(args.json_dir, exist_ok=True)
    results = {name: run(name, args) for name in names}
    tok_s = {name: r["output_tokens_per_s"] for name, r in results.items()}
    print(f"\n{'run':<8} {'prompts':>8} {'output tok/s':>13} {'req/s':>8}")
    for name, r in results.items():
        print(f"{name:<8} {r['num_requests']:>8} {tok_s[name]:>13.1f} {r['requests_per_s']:>8.2f}")
    if "tp2-mp" in tok_s and "tp2-ray" in tok_s:
        print(f"tp2: ray / mp = {tok_s['tp2-ray'] / tok_s['tp2-mp']:.3f} (target >= 0.97)")
    for dp2 in ("dp2-mp", "dp2-ray"):
        if "dp1" in tok_s and dp2 in tok_s:
            print(f"{dp2} / dp1 = {tok_s[dp2] / tok_s['dp1']:.2f}x (target >= 1.9x)")
    with open(os.path.join(args.json_dir, "summary.json"), "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
