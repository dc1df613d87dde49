"""Pipeline against tensor parallelism on two GPUs, with `minivllm bench throughput` (dummy weights).

    python benchmarks/pp_vs_tp.py [--model benchmarks/configs/qwen3-8b] [--json-dir DIR] [--only NAME,...]

Runs, one engine at a time, on the Qwen3-8B shape (the same random workload for all):
  tp1   one GPU (the baseline)
  tp2   tensor_parallel_size=2: every layer split over both GPUs, two all-reduces per layer
  pp2   pipeline_parallel_size=2: 18 layers per GPU, the activations sent once per step, two
        batches in flight, each stage's layers as CUDA graphs
  tp2-eager, pp2-eager  the same without CUDA graphs, to separate the graphs' share from the split's
and prints output tokens/s and the ratios. Needs two CUDA devices (skips cleanly otherwise).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput_runs  # noqa: E402

RUNS = {
    "tp1": [],
    "tp2": ["--tensor-parallel-size", "2"],
    "tp2-eager": ["--tensor-parallel-size", "2", "--enforce-eager"],
    "pp2": ["--pipeline-parallel-size", "2"],
    "pp2-eager": ["--pipeline-parallel-size", "2", "--enforce-eager"],
}


def main() -> int:
    args = throughput_runs.parse_args(__doc__, "qwen3-8b", RUNS, "/tmp/pp_vs_tp")
    if not throughput_runs.have_two_gpus():
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    os.makedirs(args.json_dir, exist_ok=True)
    results = {name: throughput_runs.run(name, RUNS[name], args, args.num_prompts) for name in names}
    tok_s = throughput_runs.report(results, args.json_dir)
    for name in ("tp2", "tp2-eager", "pp2", "pp2-eager"):
        if "tp1" in tok_s and name in tok_s:
            print(f"{name} / tp1 = {tok_s[name] / tok_s['tp1']:.2f}x")
    for name in ("pp2", "pp2-eager"):
        if name in tok_s and "tp2" in tok_s:
            print(f"{name} / tp2 = {tok_s[name] / tok_s['tp2']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
