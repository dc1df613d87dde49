"""`minivllm bench compare`: one serving workload through several deployments, one report.

    minivllm bench compare --model DIR --setups v0,v1,1p1d --request-rate 1,2,4 \\
        --input-len 2048:8192 --output-len 256 --num-prompts 64 --goodput ttft:2000 tpot:100 --out-dir DIR

Setups (each started fresh as real `minivllm serve` processes, measured, stopped):
  v0     one instance, the pre-V1 policy (whole-prompt prefill steps, then decode steps)
  v1     one instance, V1 chunked prefill (prefill chunks and decodes share each step)
  v1x2   two V1 instances behind `minivllm proxy` (no prefill stage): the same hardware as 1p1d
  tp2    one V1 instance with tensor parallelism over two devices
  1p1d   a prefill instance (KV producer) and a decode instance (KV consumer) behind the proxy
With --gpus 0,1 the first instance of a setup runs on GPU 0 and the second on GPU 1 (tp2 gets both).
The workload is `bench serve`'s (random token prompts, streamed, ignore_eos, Poisson arrivals), with
prompts of its own at each rate (so no rate is served from the prefix cache the one before filled). The
report (report.md, results.json, PNGs: TTFT and ITL CDFs per rate, throughput and latency against
rate) says for each setup and rate: TTFT / ITL p50, p99, throughput, goodput under the SLOs, and for
1p1d the KV transfer rate the decode instance measured (GB/s), next to the device-to-device copy
bandwidth measured on this machine when it has two GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np

SETUPS = ("v0", "v1", "v1x2", "tp2", "1p1d")
# The decode instance's connector appends one JSON line {"bytes", "seconds"} per pulled request here.
KV_TRANSFER_STATS_ENV = "MINIVLLM_KV_TRANSFER_STATS"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A `minivllm serve` or `minivllm proxy` child, logged to a file, up once /health answers 200."""

    def __init__(self, name: str, argv: list[str], log_dir: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "w")
        command = [sys.executable, "-m", "minivllm.frontend.cli", *argv, "--port", str(self.port)]
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}:\n"
                                   + open(self.log_path).read()[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.HTTPError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not healthy within {timeout:.0f} s; see {self.log_path}")
            time.sleep(0.5)

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its engine and workers too (its own session)
                self.proc.wait()
        self.log.close()


def start_setup(setup: str, model: str, serve_args: list[str], gpus: list[str], log_dir: str,
                kv_stats_path: str, startup_timeout: float) -> tuple[str, list[Process]]:
    """Start a setup's processes; returns the URL to load and the processes (to stop)."""

    def env_for(*devices: str) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(devices)} if gpus else {}

    def gpu(i: int) -> str:
        return gpus[i % len(gpus)] if gpus else ""

    def serve(name: str, extra: list[str], env: dict[str, str]) -> Process:
        return Process(f"{setup}-{name}", ["serve", "--model", model, *serve_args, *extra], log_dir, env)

    procs: list[Process] = []
    try:
        if setup in ("v0", "v1"):
            extra = ["--scheduling-policy", "v0"] if setup == "v0" else []
            procs.append(serve("instance", extra, env_for(gpu(0))))
        elif setup == "tp2":
            procs.append(serve("instance", ["--tensor-parallel-size", "2"], env_for(gpu(0), gpu(1))))
        elif setup == "v1x2":
            procs += [serve("instance0", [], env_for(gpu(0))), serve("instance1", [], env_for(gpu(1)))]
        elif setup == "1p1d":
            procs.append(serve("prefill", ["--kv-transfer-role", "producer", "--kv-port", str(free_port())],
                               env_for(gpu(0))))
            procs.append(serve("decode", ["--kv-transfer-role", "consumer"],
                               {**env_for(gpu(1)), KV_TRANSFER_STATS_ENV: kv_stats_path}))
        else:
            raise ValueError(f"unknown setup {setup!r}; choose from {', '.join(SETUPS)}")
        for proc in procs:
            proc.wait_healthy(startup_timeout)
        if setup == "1p1d":
            proxy = Process(f"{setup}-proxy", ["proxy", "--prefill", procs[0].url, "--decode", procs[1].url], log_dir)
            procs.append(proxy)
            proxy.wait_healthy(60)
            return proxy.url, procs
        if setup == "v1x2":
            proxy = Process(f"{setup}-proxy", ["proxy", "--decode", f"{procs[0].url},{procs[1].url}"], log_dir)
            procs.append(proxy)
            proxy.wait_healthy(60)
            return proxy.url, procs
        return procs[0].url, procs
    except BaseException:
        for proc in reversed(procs):
            proc.stop()
        raise


async def run_workload(base_url: str, model: str, prompts: list[list[int]], output_lens: list[int], rate: float,
                       goodput: dict[str, float], seed: int) -> tuple[dict, dict]:
    """bench serve's run at one rate; also the raw per-request TTFTs and ITLs (for the CDFs)."""
    from minivllm.frontend.bench_serve import client_session, send_completion, summarize

    url = base_url.rstrip("/") + "/v1/completions"
    rng = np.random.default_rng(seed)
    async with client_session() as session:
        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            body = {"model": model, "prompt": prompt, "max_tokens": output_lens[i], "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.ensure_future(send_completion(session, url, {}, body, len(prompt))))
            if math.isfinite(rate) and i + 1 < len(prompts):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    done = [r for r in results if r.success]
    raw = {"ttft_s": [r.ttft for r in done], "itl_s": [gap for r in done for gap in r.itl]}
    return summarize(list(results), duration, rate, None, goodput), raw


def read_kv_transfer_stats(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    total_bytes = total_seconds = 0.0
    count = 0
    with open(path) as f:
        for line in f:
            entry = json.loads(line)
            total_bytes += entry["bytes"]
            total_seconds += entry["seconds"]
            count += 1
    if not count:
        return None
    return {"requests": count, "gigabytes": total_bytes / 1e9,
            "gb_per_s": total_bytes / 1e9 / total_seconds if total_seconds else None}


_COPY_BANDWIDTH_SCRIPT = """
import json, torch
if torch.cuda.device_count() < 2:
    print(json.dumps(None)); raise SystemExit
n = 1 << 30
src = torch.empty(n, dtype=torch.uint8, device="cuda:0")
dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
for _ in range(3):
    dst.copy_(src)
torch.cuda.synchronize(0); torch.cuda.synchronize(1)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record(torch.cuda.current_stream(0))
for _ in range(10):
    dst.copy_(src)
end.record(torch.cuda.current_stream(0))
torch.cuda.synchronize(0); torch.cuda.synchronize(1)
print(json.dumps(10 * n / 1e9 / (start.elapsed_time(end) / 1e3)))
"""


def measure_copy_bandwidth(gpus: list[str]) -> float | None:
    """GB/s of a 1 GiB copy from the first GPU to the second (None without two GPUs), in a child
    process so this one holds no CUDA context while the instances run."""
    if len(gpus) < 2:
        return None
    out = subprocess.run([sys.executable, "-c", _COPY_BANDWIDTH_SCRIPT], capture_output=True, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus[:2])}, timeout=300)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot_report(runs: dict[str, list[dict]], raws: dict[str, list[dict]], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL")):
        rates = [r["request_rate"] for r in next(iter(runs.values()))]
        fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False)
        for ax, (i, rate) in zip(axes[0], enumerate(rates)):
            for setup, per_rate in raws.items():
                values = np.sort(np.asarray(per_rate[i][key]) * 1000)
                if len(values):
                    ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=setup)
            ax.set_xlabel(f"{name} (ms)")
            ax.set_ylabel("fraction of " + ("requests" if key == "ttft_s" else "token gaps"))
            ax.set_title(f"{name} CDF at {rate} req/s")
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name.lower()}_cdf.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = [str(r["request_rate"]) for r in next(iter(runs.values()))]
    for setup, results in runs.items():
        x = np.arange(len(results))  # evenly spaced rates (inf has no place on a number line)
        axes[0].plot(x, [r["output_throughput"] for r in results], "o-", label=setup)
        axes[1].plot(x, [r["ttft_ms"]["p50"] for r in results], "o-", label=f"{setup} p50")
        axes[1].plot(x, [r["ttft_ms"]["p99"] for r in results], "s--", label=f"{setup} p99")
        axes[2].plot(x, [r["itl_ms"]["p50"] for r in results], "o-", label=f"{setup} p50")
        axes[2].plot(x, [r["itl_ms"]["p99"] for r in results], "s--", label=f"{setup} p99")
    for ax, label in zip(axes, ("output tokens/s", "TTFT (ms)", "ITL (ms)")):
        ax.set_xticks(np.arange(len(labels)), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "vs_rate.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [*paths, path]


def write_markdown(report: dict, plots: list[str], out_dir: str) -> str:
    w = report["workload"]
    lines = [f"# Serving comparison: {', '.join(report['runs'])}", "",
             f"Model `{report['model']}`; {w['num_prompts']} prompts per rate, input {w['input_len']} tokens, output "
             f"{w['output_len']} tokens (ignore_eos), Poisson arrivals; instance flags `{report['serve_args']}`; "
             f"GPUs {report['gpus'] or 'none (CPU)'}.", ""]
    if report["goodput_slos_ms"]:
        lines += [f"Goodput: requests/s meeting every SLO {report['goodput_slos_ms']} (ms).", ""]
    lines += ["| setup | rate (req/s) | done | req/s | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | "
              "TPOT p50 | goodput |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for setup, results in report["runs"].items():
        for r in results:
            goodput = f"{r['goodput']:.2f}" if r["goodput"] is not None else "-"
            lines.append(f"| {setup} | {r['request_rate']} | {r['completed']}/{r['num_prompts']} | "
                         f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {r['ttft_ms']['p50']:.1f} | "
                         f"{r['ttft_ms']['p99']:.1f} | {r['itl_ms']['p50']:.2f} | {r['itl_ms']['p99']:.2f} | "
                         f"{r['tpot_ms']['p50']:.2f} | {goodput} |")
    lines.append("")
    kv = report.get("kv_transfer")
    if kv:
        lines.append(f"1p1d KV transfer: {kv['requests']} requests, {kv['gigabytes']:.3f} GB pulled at "
                     f"{kv['gb_per_s']:.2f} GB/s (decode instance, per request from pull request to last layer "
                     "in its cache).")
    if report.get("copy_bandwidth_gb_per_s"):
        lines.append(f"Device-to-device copy bandwidth on this machine (1 GiB, GPU {report['gpus'][0]} -> "
                     f"{report['gpus'][1]}): {report['copy_bandwidth_gb_per_s']:.1f} GB/s.")
    lines += ["", *[f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots], ""]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def rate_workloads(num_prompts: int, input_len: str, output_len: str, vocab: int, seed: int, num_rates: int) -> list:
    """One workload per rate, the i-th drawn with seed + i: the same prompts again would be served
    from the prefix cache the previous rate filled, measuring cache hits instead of prefills."""
    from minivllm.frontend.bench import make_workload

    return [make_workload(num_prompts, input_len, output_len, vocab, seed + i) for i in range(num_rates)]


def load_finished_setups(out_dir: str, workload_key: dict, rates: list[float]) -> tuple[dict, dict, dict | None]:
    """The setups an earlier run in out_dir measured on this same workload and rates (for --resume:
    a long comparison split over several invocations still ends in one report)."""
    path = os.path.join(out_dir, "results.json")
    if not os.path.exists(path):
        return {}, {}, None
    with open(path) as f:
        earlier = json.load(f)
    if earlier.get("workload") != workload_key:
        raise ValueError(f"--resume: {path} was measured on workload {earlier.get('workload')}, not {workload_key}; "
                         "use another --out-dir or the same workload flags")
    runs, raws = {}, {}
    for setup, results in earlier["runs"].items():
        if [float(r["request_rate"]) for r in results] == [float(r) for r in rates]:  # float("inf") too
            runs[setup], raws[setup] = results, earlier["raw"][setup]
    return runs, raws, earlier.get("kv_transfer")


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from minivllm.frontend.bench_serve import parse_goodput, parse_rates, print_result, vocab_size_of

    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or not setups:
        raise ValueError(f"--setups takes a comma-separated list of {', '.join(SETUPS)}; got {args.setups!r}")
    if args.model is None or not os.path.isdir(args.model):
        raise ValueError(f"--model must be a local model directory, got {args.model!r}")
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus else []
    rates = parse_rates(args.request_rate)
    goodput = parse_goodput(args.goodput)
    serve_args = shlex.split(args.serve_args or "")
    vocab = vocab_size_of(args.model)
    workloads = rate_workloads(args.num_prompts, args.input_len, args.output_len, vocab, args.seed, len(rates))
    os.makedirs(args.out_dir, exist_ok=True)
    log_dir = os.path.join(args.out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    copy_bandwidth = measure_copy_bandwidth(gpus)
    kv_stats_path = os.path.join(tempfile.mkdtemp(prefix="minivllm-kv-stats-"), "kv_transfer.jsonl")
    runs: dict[str, list[dict]] = {}
    raws: dict[str, list[dict]] = {}
    workload_key = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                    "seed": args.seed, "prompts": "distinct per rate"}
    kept_kv_transfer = None
    if args.resume:
        runs, raws, kept_kv_transfer = load_finished_setups(args.out_dir, workload_key, rates)
        print(f"resuming: keeping {', '.join(runs) or 'nothing'} from {args.out_dir}/results.json", flush=True)

    def save() -> dict:
        """results.json as it stands (after every setup, so an interrupted run can --resume)."""
        kv_transfer = read_kv_transfer_stats(kv_stats_path) if "1p1d" in setups and "1p1d" in raws else None
        report = {"model": args.model, "serve_args": args.serve_args or "", "gpus": gpus,
                  "workload": workload_key, "goodput_slos_ms": goodput or None, "runs": runs,
                  "kv_transfer": kv_transfer or kept_kv_transfer, "copy_bandwidth_gb_per_s": copy_bandwidth}
        with open(os.path.join(args.out_dir, "results.json"), "w") as f:
            json.dump({**report, "raw": raws}, f, indent=1)
        return report

    for setup in setups:
        if setup in runs:
            continue
        print(f"=== {setup}: starting", flush=True)
        url, procs = start_setup(setup, args.model, serve_args, gpus, log_dir, kv_stats_path, args.startup_timeout)
        try:
            model = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())["data"][0]["id"]
            # A short warm-up request (first-step compilation, connections) before anything is measured.
            warm_up = [[(token + 1) % vocab for token in workloads[0].prompts[0][:32]]]  # shares no block
            asyncio.run(run_workload(url, model, warm_up, [4], math.inf, {}, args.seed))
            runs[setup], raws[setup] = [], []
            for rate, workload in zip(rates, workloads):
                result, raw = asyncio.run(run_workload(url, model, workload.prompts, workload.output_lens, rate,
                                                       goodput, args.seed))
                result["setup"] = setup
                print(f"--- {setup} at {rate} req/s")
                print_result(result)
                runs[setup].append(result)
                raws[setup].append(raw)
        finally:
            for proc in reversed(procs):
                proc.stop()
        save()
    report = save()
    plots = plot_report(runs, raws, args.out_dir)
    print(f"report: {write_markdown(report, plots, args.out_dir)}")
    return 0 if all(r["completed"] == r["num_prompts"] for results in runs.values() for r in results) else 1


def add_bench_compare_parser(kinds: argparse._SubParsersAction) -> None:
    cp = kinds.add_parser("compare", help="the same serving workload through v0, V1 chunked prefill, 1P1D "
                          "disaggregation (and more): one report with plots",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cp.add_argument("--model", required=True, help="local model directory every instance serves")
    cp.add_argument("--setups", default="v0,v1,1p1d", help=f"comma-separated, of: {', '.join(SETUPS)}")
    cp.add_argument("--serve-args", default="",
                    help="flags every instance gets, as one string, e.g. \"--dtype bfloat16 --max-model-len 9000\"")
    cp.add_argument("--gpus", default=None,
                    help="CUDA devices, e.g. 0,1: a setup's first instance on the first, second on the second")
    cp.add_argument("--num-prompts", type=int, default=64)
    cp.add_argument("--input-len", default="2048:8192", help="prompt length N or range LO:HI (uniform)")
    cp.add_argument("--output-len", default="256", help="output length N or range LO:HI; EOS ignored")
    cp.add_argument("--request-rate", default="1,2,4", help="comma-separated requests/s (Poisson), or inf")
    cp.add_argument("--goodput", nargs="+", default=None, metavar="SLO", help="SLOs in ms: ttft:MS tpot:MS e2el:MS")
    cp.add_argument("--seed", type=int, default=0)
    cp.add_argument("--startup-timeout", type=float, default=600.0, help="seconds an instance may take to come up")
    cp.add_argument("--out-dir", default="bench_compare", help="where report.md, results.json, PNGs and logs go")
    cp.add_argument("--resume", action="store_true",
                    help="keep the setups OUT_DIR/results.json already holds for this workload and rates, run the "
                         "rest, and report them all (splits a long comparison over several invocations)")
    cp.set_defaults(func=cmd_bench_compare)
