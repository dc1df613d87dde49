"""What benchmarks/ray_vs_mp.py and pp_vs_tp.py share: run named `minivllm bench throughput`
configurations one engine at a time on the same random workload, and tabulate them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = ["--load-format", "dummy", "--input-len", "100:1024", "--output-len", "256", "--seed", "0",
            "--no-roofline"]


def parse_args(doc: str, default_model: str, runs: dict[str, list[str]], default_json_dir: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.join(ROOT, "benchmarks", "configs", default_model))
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--json-dir", default=os.environ.get("OUT", default_json_dir))
    parser.add_argument("--only", default=",".join(runs), help=f"comma-separated subset of {', '.join(runs)}")
    return parser.parse_args()


def have_two_gpus() -> bool:
    import torch

    if torch.cuda.device_count() < 2:
        print(f"skipped: needs 2 CUDA devices, found {torch.cuda.device_count()}")
        return False
    return True


def run(name: str, flags: list[str], args: argparse.Namespace, num_prompts: int) -> dict:
    """One `bench throughput` run in its own process; its result row."""
    path = os.path.join(args.json_dir, f"{name}.json")
    command = [sys.executable, os.path.join(ROOT, "bin", "minivllm"), "bench", "throughput", "--model", args.model,
               "--num-prompts", str(num_prompts), *WORKLOAD, *flags, "--json", path]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    with open(path) as f:
        return json.load(f)["results"][0]


def report(results: dict[str, dict], json_dir: str) -> dict[str, float]:
    """Print the table, save summary.json; output tokens/s by name."""
    tok_s = {name: r["output_tokens_per_s"] for name, r in results.items()}
    print(f"\n{'run':<10} {'prompts':>8} {'output tok/s':>13} {'req/s':>8}")
    for name, r in results.items():
        print(f"{name:<10} {r['num_requests']:>8} {tok_s[name]:>13.1f} {r['requests_per_s']:>8.2f}")
    with open(os.path.join(json_dir, "summary.json"), "w") as f:
        json.dump(results, f, indent=2)
    return tok_s
