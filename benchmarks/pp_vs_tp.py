"""Pipeline against tensor parallelism on two GPUs, with `minivllm bench throughput` (dummy weights).

    python benchmarks/pp_vs_tp.py [--model benchmarks/configs/qwen3-8b] [--json-dir DIR] [--only NAME,...]

Runs, one engine at a time, on the Qwen3-8B shape (the same random workload for all):
  tp1   one GPU (the baseline)
  tp2   tensor_parallel_size=2: every layer split over both GPUs, two all-reduces per layer
  pp2   pipeline_parallel_size=2: 18 layers per GPU, the activations sent once per step, two
        batches in flight (eager: pipeline stages run without CUDA graphs)
  tp2-eager  tp2 without CUDA graphs, to separate the graphs' share from the split's
and prints output tokens/s and the ratios. Needs two CUDA devices (skips cleanly otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = ["--load-format", "dummy", "--input-len", "100:1024", "--output-len", "256", "--seed", "0",
            "--no-roofline"]
RUNS = {
    "tp1": [],
    "tp2": ["--tensor-parallel-size", "2"],
    "tp2-eager": ["--tensor-parallel-size", "2", "--enforce-eager"],
    "pp2": ["--pipeline-parallel-size", "2"],
}


def run(name: str, args: argparse.Namespace) -> dict:
    path = os.path.join(args.json_dir, f"{name}.json")
    command = [sys.executable, os.path.join(ROOT, "bin", "minivllm"), "bench", "throughput", "--model", args.model,
               "--num-prompts", str(args.num_prompts), *WORKLOAD, *RUNS[name], "--json", path]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    with open(path) as f:
        return json.load(f)["results"][0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.join(ROOT, "benchmarks", "configs", "qwen3-8b"))
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--json-dir", default=os.environ.get("OUT", "/tmp/pp_vs_tp"))
    parser.add_argument("--only", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    args = parser.parse_args()
    import torch

    if torch.cuda.device_count() < 2:
        print(f"skipped: needs 2 CUDA devices, found {torch.cuda.device_count()}")
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    os.makedirs(args.json_dir, exist_ok=True)
    results = {name: run(name, args) for name in names}
    tok_s = {name: r["output_tokens_per_s"] for name, r in results.items()}
    print(f"\n{'run':<10} {'prompts':>8} {'output tok/s':>13} {'req/s':>8}")
    for name, r in results.items():
        print(f"{name:<10} {r['num_requests']:>8} {tok_s[name]:>13.1f} {r['requests_per_s']:>8.2f}")
    for name in ("tp2", "tp2-eager", "pp2"):
        if "tp1" in tok_s and name in tok_s:
            print(f"{name} / tp1 = {tok_s[name] / tok_s['tp1']:.2f}x")
    if "pp2" in tok_s and "tp2" in tok_s:
        print(f"pp2 / tp2 = {tok_s['pp2'] / tok_s['tp2']:.2f}x")
    with open(os.path.join(args.json_dir, "summary.json"), "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
