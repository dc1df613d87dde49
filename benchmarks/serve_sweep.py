"""The serving benchmark of issue 12, in one run: `minivllm serve` under a request-rate sweep,
then the same workload through `LLM.generate` for the rate-inf comparison.

    source benchmarks/device_setup.sh
    python benchmarks/serve_sweep.py --out $OUT/serve            # H100: Qwen3-0.6B shape, dummy weights
    python benchmarks/serve_sweep.py --smoke --out /tmp/serve    # CPU: a tiny model, tiny sizes

Steps: (1) start `minivllm serve` on the model; (2) an unloaded run (a few requests at
--unloaded-rate) gives the baseline TPOT, then `bench serve` at each --rates value (fresh random
prompts per rate, so no rate profits from the prefix cache of another); (3) the highest rate whose
p99 TPOT stays under --tpot-factor x the unloaded p99 TPOT; (4) stop the server (SIGTERM) and run
the rate-inf workload (same prompts, same lengths, greedy, EOS ignored) through LLM.generate in this
process; (5) write sweep.json, sweep.png and summary.md under --out.

Engine flags after `--` go to both the server and LLM (e.g. `-- --max-num-seqs 512`).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for sweep.json, sweep.png, summary.md, server.log")
    p.add_argument("--model", default=os.path.join(REPO_ROOT, "benchmarks", "configs", "qwen3-0.6b"))
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--num-prompts", type=int, default=256, help="prompts of the rate-inf run (and the cap per rate)")
    p.add_argument("--input-len", default="100:1024")
    p.add_argument("--output-len", default="256")
    p.add_argument("--rates", default="8,16,32,48,64,96,inf", help="loaded request rates (req/s), ascending")
    p.add_argument("--unloaded-rate", type=float, default=1.0)
    p.add_argument("--unloaded-prompts", type=int, default=16)
    p.add_argument("--max-seconds-per-rate", type=float, default=30.0,
                   help="a finite rate R sends min(num-prompts, max(--min-prompts, R x this)) prompts")
    p.add_argument("--min-prompts", type=int, default=64)
    p.add_argument("--tpot-factor", type=float, default=2.0)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the script: a tiny random model and tiny sizes (needs tests/ of the checkout)")
    args = p.parse_args(argv)
    if args.smoke:
        sys.path.insert(0, REPO_ROOT)
        from tests.tiny_models import build_tiny_model

        args.model = build_tiny_model(os.path.join(tempfile.mkdtemp(prefix="serve-sweep-"), "tiny"))
        args.load_format = "auto"
        args.num_prompts, args.input_len, args.output_len = 24, "8:48", "16"
        args.rates, args.unloaded_prompts, args.min_prompts, args.max_seconds_per_rate = "8,32,inf", 4, 8, 2.0
        args.unloaded_rate = 2.0
        extra = ["--device", "cpu", "--max-model-len", "256", *extra]
    return args, extra


class Server:
    def __init__(self, args: argparse.Namespace, extra: list[str], log_path: str) -> None:
        self.url = f"http://127.0.0.1:{args.port}"
        self.log = open(log_path, "w")
        command = [sys.executable, "-m", "minivllm.frontend.cli", "serve", "--model", args.model,
                   "--load-format", args.load_format, "--port", str(args.port), "--disable-uvicorn-access-log",
                   "--served-model-name", "bench-model", *extra]
        print("$", " ".join(command), flush=True)
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - start > args.startup_timeout:
                self.stop()
                raise RuntimeError(f"the server did not come up in {args.startup_timeout} s; see {log_path}")
            time.sleep(0.5)
        self.startup_s = time.monotonic() - start
        print(f"server up in {self.startup_s:.1f} s", flush=True)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def prompts_for(rate: float, args: argparse.Namespace) -> int:
    if math.isinf(rate):
        return args.num_prompts
    return min(args.num_prompts, max(args.min_prompts, math.ceil(rate * args.max_seconds_per_rate)))


def run_llm_generate(args: argparse.Namespace, extra: list[str], prompts: list[list[int]],
                     output_lens: list[int]) -> dict:
    from minivllm.frontend.cli import add_engine_args, engine_kwargs
    from minivllm.frontend.llm import LLM
    from minivllm.protocol.sampling_params import SamplingParams

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    engine_args = parser.parse_args(["--model", args.model, "--load-format", args.load_format, *extra])
    kwargs = engine_kwargs(engine_args)
    if "max_pending_requests" not in inspect.signature(LLM.__init__).parameters:
        kwargs.pop("max_pending_requests", None)  # an admission bound; offline it changes nothing
    with LLM(args.model, **kwargs) as llm:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(inputs[:8], params[:8], use_tqdm=False)  # warm-up
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"num_prompts": len(prompts), "elapsed_s": elapsed, "total_output_tokens": output_tokens,
            "request_throughput": len(prompts) / elapsed, "output_throughput": output_tokens / elapsed}


async def sweep(args: argparse.Namespace, server: Server, vocab: int) -> tuple[dict, list[dict]]:
    from minivllm.frontend.bench import make_workload
    from minivllm.frontend.bench_serve import run_at_rate

    async def run(rate: float, num: int, seed: int) -> dict:
        workload = make_workload(num, args.input_len, args.output_len, vocab, seed)
        result = await run_at_rate(server.url, "bench-model", workload.prompts, workload.output_lens, rate,
                                   seed=seed)
        print(f"rate {result['request_rate']:>5}: {num} prompts, {result['completed']} done, "
              f"{result['output_throughput']:.0f} out tok/s, TTFT p50/p99 {result['ttft_ms']['p50']:.1f}/"
              f"{result['ttft_ms']['p99']:.1f} ms, TPOT p50/p99 {result['tpot_ms']['p50']:.2f}/"
              f"{result['tpot_ms']['p99']:.2f} ms ({result['duration_s']:.1f} s)", flush=True)
        if result["failed"]:
            print(f"  failed: {result['failed']}: {result['errors']}", flush=True)
        return result

    await run(math.inf, min(8, args.num_prompts), args.seed + 1000)  # warm-up, not reported
    unloaded = await run(args.unloaded_rate, args.unloaded_prompts, args.seed + 2000)
    loaded = []
    for i, rate in enumerate(float(r) for r in args.rates.split(",")):
        # Rate inf gets the base seed: the very prompts LLM.generate runs afterwards.
        loaded.append(await run(rate, prompts_for(rate, args), args.seed if math.isinf(rate) else args.seed + 1 + i))
    return unloaded, loaded


def main() -> int:
    args, extra = parse_args()
    os.makedirs(args.out, exist_ok=True)
    from minivllm.frontend.bench import make_workload
    from minivllm.frontend.bench_serve import plot_results, vocab_size_of

    vocab = vocab_size_of(args.model) or 10000
    begin = time.monotonic()
    server = Server(args, extra, os.path.join(args.out, "server.log"))
    try:
        unloaded, loaded = asyncio.run(sweep(args, server, vocab))
    finally:
        server_rc = server.stop()
    print(f"server stopped (exit {server_rc})", flush=True)
    workload = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    offline = run_llm_generate(args, extra, workload.prompts, workload.output_lens)
    print(f"LLM.generate: {offline['output_throughput']:.0f} out tok/s ({offline['elapsed_s']:.1f} s)", flush=True)

    limit = args.tpot_factor * unloaded["tpot_ms"]["p99"]
    within = [r for r in loaded if r["completed"] == r["num_prompts"] and r["tpot_ms"]["p99"] <= limit]
    best = within[-1] if within else None
    inf_run = next((r for r in loaded if r["request_rate"] == "inf"), None)
    ratio = inf_run["output_throughput"] / offline["output_throughput"] if inf_run else None
    report = {"model": args.model, "load_format": args.load_format, "engine_args": extra,
              "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                           "output_len": args.output_len, "seed": args.seed},
              "server_startup_s": server.startup_s, "server_exit_code": server_rc,
              "unloaded": unloaded, "rates": loaded, "tpot_p99_limit_ms": limit,
              "highest_rate_within_limit": best["request_rate"] if best else None,
              "llm_generate": offline, "server_inf_vs_llm_generate": ratio,
              "total_wall_s": time.monotonic() - begin}
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(report, f, indent=2)
    try:
        plot_results([unloaded, *loaded], os.path.join(args.out, "sweep.png"),
                     f"minivllm serve: input {args.input_len}, output {args.output_len}")
    except ImportError as e:  # no matplotlib on this machine: the JSON and the summary still count
        print(f"no plot: {e}", flush=True)

    lines = [f"# minivllm serve: request-rate sweep ({os.path.basename(args.model.rstrip('/'))}, "
             f"{args.load_format} weights)", "",
             f"Workload: random-token prompts, input {args.input_len}, output {args.output_len} (EOS ignored), "
             f"greedy, streamed /v1/completions; {args.num_prompts} prompts at rate inf, "
             f"min({args.num_prompts}, max({args.min_prompts}, rate x {args.max_seconds_per_rate:g} s)) at a "
             f"finite rate; unloaded: {args.unloaded_prompts} prompts at {args.unloaded_rate:g} req/s. "
             f"Engine flags: {' '.join(extra) or '(defaults)'}.", "",
             "| rate (req/s) | prompts | req/s | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | "
             "ITL p99 | E2E p99 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in [(f"{args.unloaded_rate:g} (unloaded)", unloaded)] + [(str(r["request_rate"]), r) for r in loaded]:
        lines.append(f"| {name} | {r['num_prompts']} | {r['request_throughput']:.2f} | {r['output_throughput']:,.0f} | "
                     f"{r['ttft_ms']['p50']:.1f} | {r['ttft_ms']['p99']:.1f} | {r['tpot_ms']['p50']:.2f} | "
                     f"{r['tpot_ms']['p99']:.2f} | {r['itl_ms']['p99']:.2f} | {r['e2e_ms']['p99']:.0f} |")
    lines += ["", "Latencies in ms.", ""]
    if best:
        lines.append(f"**Highest rate with p99 TPOT under {args.tpot_factor:g}x unloaded "
                     f"({unloaded['tpot_ms']['p99']:.2f} ms -> limit {limit:.2f} ms): {best['request_rate']} req/s** "
                     f"(TTFT p50/p99 {best['ttft_ms']['p50']:.1f}/{best['ttft_ms']['p99']:.1f} ms, TPOT p50/p99 "
                     f"{best['tpot_ms']['p50']:.2f}/{best['tpot_ms']['p99']:.2f} ms).")
    else:
        lines.append(f"No loaded rate kept p99 TPOT under {limit:.2f} ms ({args.tpot_factor:g}x unloaded).")
    if inf_run:
        lines.append(f"\nRate inf through the server: {inf_run['output_throughput']:,.0f} output tok/s; the same "
                     f"{args.num_prompts} prompts through LLM.generate: {offline['output_throughput']:,.0f} output "
                     f"tok/s; server / offline = {ratio:.3f}.")
    lines.append(f"\nServer start-up {server.startup_s:.0f} s; whole run {report['total_wall_s']:.0f} s.")
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
