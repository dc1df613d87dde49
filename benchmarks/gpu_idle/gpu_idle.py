"""Where the GPU waits for the host in `bench throughput`: the worker's kernels over the measured
run's first steps, the idle gaps between them, and what the worker's host was doing during the
largest ones.

    python3 benchmarks/gpu_idle/gpu_idle.py --steps 40 -- --model benchmarks/configs/qwen3-0.6b \
        --load-format dummy --num-prompts 256 --input-len 100:1024 --output-len 256

Runs `minivllm bench throughput` with the arguments after `--` and this directory on PYTHONPATH, so
that sitecustomize.py profiles the worker process (torch.profiler, CUDA kernels and the named
ModelRunner calls; no change to minivllm). Profiling starts at the first step that schedules more
new requests than --min-new (bench's warm-up sends 8, all in its first step) and covers --steps
steps (after --skip unprofiled ones); the worker prints its report (GPU_IDLE lines: the largest
gaps, and kernel time by kernel name) when they are done. Needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--min-new", type=int, default=8)
    parser.add_argument("--skip", type=int, default=0, help="steps left unprofiled from the first measured one")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    env = dict(os.environ, MINIVLLM_GPU_IDLE_STEPS=str(args.steps), MINIVLLM_GPU_IDLE_MIN_NEW=str(args.min_new),
               MINIVLLM_GPU_IDLE_SKIP=str(args.skip),
               PYTHONPATH=os.pathsep.join([HERE, *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = [sys.executable, "-m", "minivllm.frontend.cli", "bench", "throughput", *bench_args]
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
