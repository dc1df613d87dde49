"""Where a batch-1 request's time to first token goes, across the frontend, the EngineCore and
the worker: a timeline of one request, as `bench latency` times it.

    python3 benchmarks/timeline/request_timeline.py --model benchmarks/configs/qwen3-0.6b \
        --load-format dummy --input-len 128 --num-iters 20

Re-runs itself with this directory on PYTHONPATH, so that sitecustomize.py timestamps the entry and
exit of the calls it names in every process (no change to minivllm itself); each iteration is one
`generate` of max_tokens=1 after a prefix-cache reset (with --prefix-len, after a request that caches
a prefix the timed prompt follows: a long chat's new turn). Then prints, per stage of the request's way
(the first matching mark after the previous stage's), the median time it took, and the marks of the
median iteration. The marks cost a few microseconds each, so the total reads a little above
`bench latency`'s. (On the CPU no graph is launched: that stage is the forward itself.)
"""

from __future__ import annotations

import argparse
import builtins
import glob
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (stage, the mark that ends it: or one of several, by executor), in the order a request meets them
STAGES = [
    ("frontend: generate() until the request is sent", "> EngineCoreClient._send"),
    ("to the engine's socket thread", "> EngineCoreProc._receive_frames"),
    ("decoded, checked, queued to the busy loop", "> EngineCoreProc._handle"),
    ("scheduled", "< Scheduler.schedule"),
    ("submitted to the worker", "< ChannelExecutor.submit"),  # (none with the worker in the engine: "uni")
    ("to the worker", "> ModelRunner.run_step"),
    ("worker: batch updated, inputs prepared", "< InputBatch.prepare"),
    ("worker: inputs copied, graph launched", "< run_forward"),
    ("worker: logits and sampling launched", "< ModelRunner.run_step"),
    ("worker: sampled token on the host", "< ModelRunner.finish_pending"),
    ("to the engine", ("< ChannelExecutor.receive_output", "< UniProcExecutor.receive_output")),
    ("engine: outputs made", "> EngineCoreProc._send_outputs"),
    # (Where the socket thread starts sending, not where it is done: on a busy host the frontend can
    # receive, finish and mark its iteration's end before the sender is scheduled to mark its own.)
    ("to the socket thread", "> EngineCoreProc._send_to"),
    ("sent, to the frontend", "> EngineCoreClient._on_message"),
    ("frontend: output processed, generate() returns", "ITER"),
]


def run_iterations(args: argparse.Namespace) -> None:
    """The timed loop (in the child, with the marks on)."""
    from minivllm.frontend.llm import LLM
    from minivllm.protocol.sampling_params import SamplingParams

    mark = builtins.__timeline_mark__
    with LLM(args.model, skip_tokenizer_init=True, load_format=args.load_format,
             distributed_executor_backend=args.distributed_executor_backend) as llm:
        vocab = llm.engine_info.vocab_size
        prompt = {"prompt_token_ids": [(i * 7919) % (vocab - 10) + 10 for i in range(args.input_len)]}
        first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        rng = random.Random(0)
        for i in range(args.num_iters):
            llm.reset_prefix_cache()
            if args.prefix_len:  # a new turn: a cached prefix of its own, then the prompt after it
                prefix = [rng.randrange(10, vocab - 10) for _ in range(args.prefix_len)]
                llm.generate({"prompt_token_ids": prefix}, first, use_tqdm=False)
                prompt = {"prompt_token_ids": prefix + [rng.randrange(10, vocab - 10) for _ in range(args.input_len)]}
            mark(f"ITER {i} start")
            llm.generate(prompt, first, use_tqdm=False)
            mark(f"ITER {i} end")
            time.sleep(args.idle_ms / 1000)


def read_marks(trace_dir: str) -> list[tuple[float, str, str, str]]:
    marks = []
    for path in glob.glob(os.path.join(trace_dir, "trace-*.txt")):
        with open(path) as f:
            for line in f:
                t, pid, thread, label = line.rstrip("\n").split(" ", 3)
                marks.append((float(t), pid, thread, label))
    return sorted(marks)


def report(trace_dir: str) -> None:
    marks = read_marks(trace_dir)
    starts = [i for i, m in enumerate(marks) if m[3].startswith("ITER") and m[3].endswith("start")]
    ends = [i for i, m in enumerate(marks) if m[3].startswith("ITER") and m[3].endswith("end")]
    stage_us: dict[str, list[float]] = {name: [] for name, _ in STAGES}
    totals = []
    for s, e in zip(starts, ends):
        prev, pos = marks[s][0], s + 1

        def find(label, start: int) -> int | None:
            return next((i for i in range(start, e + 1) if marks[i][3].startswith(label)), None)

        for k, (name, label) in enumerate(STAGES):
            found = find(label, pos)
            if found is None:  # a stage this run does not have (on the CPU no token is held back)
                continue
            end, end_pos = marks[found][0], found + 1
            following = find(STAGES[k + 1][1], pos) if k + 1 < len(STAGES) else None
            if following is not None and following < found and marks[following][1] != marks[found][1]:
                # A sender marks its exit after its send returns; on a busy host the receiver (in
                # another process) can run and mark first. The stage ended no later than the
                # receiver began: the next stage gets 0 in this iteration.
                end, end_pos = marks[following][0], following
            stage_us[name].append((end - prev) * 1e6)
            prev, pos = end, end_pos
        totals.append((marks[e][0] - marks[s][0], s, e))
    print(f"{len(totals)} iterations: time to first token median {statistics.median(t for t, _, _ in totals) * 1e3:.3f} ms")
    for name, _ in STAGES:
        if stage_us[name]:
            print(f"  {name:50s} {statistics.median(stage_us[name]):7.1f} us")
    _, s, e = sorted(totals)[len(totals) // 2]
    print("the median iteration (ms from its start, us since the mark before, pid, thread, mark):")
    prev = t0 = marks[s][0]
    for t, pid, thread, label in marks[s:e + 1]:
        print(f"  {(t - t0) * 1e3:7.3f} +{(t - prev) * 1e6:7.1f}  {pid:>7s} {thread:>5s}  {label}")
        prev = t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=20)
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="time a new turn instead: --input-len tokens after this many cached ones (a prefix "
                             "of its own each iteration, run once before it is timed)")
    parser.add_argument("--idle-ms", type=float, default=0.0, help="pause between iterations")
    parser.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "uni"],
                        help="uni: the worker inside the EngineCore process")
    parser.add_argument("--trace-dir", default=None, help="keep the raw marks here (default: a temporary directory)")
    args = parser.parse_args()
    if os.environ.get("TIMELINE_DIR"):  # the child: the marks are on
        run_iterations(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = args.trace_dir or tmp
        os.makedirs(trace_dir, exist_ok=True)
        env = dict(os.environ, TIMELINE_DIR=trace_dir,
                   PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
        subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env=env, check=True)
        report(trace_dir)


if __name__ == "__main__":
    main()
