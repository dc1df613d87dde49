"""`minivllm bench serve`: load an OpenAI-compatible server the way `vllm bench serve` does.

Random-token prompts (lengths from --input-len LO:HI, the same workload as `bench throughput` for
the same seed) go to /v1/completions as token-id lists with stream=true, ignore_eos and max_tokens
from --output-len; requests arrive as a Poisson process at --request-rate (inf: all at once), at
most --max-concurrency in flight. Per request: time to first token (TTFT), time per output token
after the first (TPOT), the gaps between streamed chunks (ITL) and end-to-end latency (E2E);
overall: request and token throughput, and goodput (requests/s meeting every --goodput SLO).

Only plain OpenAI HTTP is spoken (plus vLLM's ignore_eos), so it measures a vLLM server as well.
The HTTP client is aiohttp, as in vLLM's benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from minivllm.frontend.bench import make_workload

logger = logging.getLogger(__name__)

DEFAULT_VOCAB = 10000  # token ids drawn below this when the model's vocabulary size is unknown


class HTTPError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


def client_session() -> aiohttp.ClientSession:
    """An HTTP session without a connection cap (--max-concurrency is the only limit) or a total
    timeout (a long generation at a high rate may take minutes)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=60))


async def get_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> dict:
    async with session.get(url, headers=headers) as response:
        text = await response.text()
    if response.status != 200:
        raise HTTPError(response.status, text)
    return json.loads(text)


# ---------------------------------------------------------------- one request


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, send to last byte
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def send_completion(session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict,
                          prompt_len: int) -> RequestResult:
    """One streamed completion, timed: TTFT at the first chunk carrying text or tokens, ITL between
    chunks; the token count from the usage chunk (or the chunks, if the server sends no usage)."""
    result = RequestResult(prompt_len)
    start = time.perf_counter()
    last = start
    num_chunks = 0
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            buffer = b""
            async for piece in response.content.iter_any():
                buffer += piece
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    event = event.strip()
                    if not event.startswith(b"data:"):
                        continue
                    data = event[5:].strip()
                    if data == b"[DONE]":
                        continue
                    message = json.loads(data)
                    if "error" in message:
                        result.error = json.dumps(message["error"])[:300]
                        return result
                    now = time.perf_counter()
                    if message.get("choices"):
                        if num_chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        num_chunks += 1
                        last = now
                    if message.get("usage"):
                        result.output_tokens = message["usage"].get("completion_tokens", 0)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = last - start
    result.output_tokens = result.output_tokens or num_chunks
    result.success = num_chunks > 0
    if not result.success:
        result.error = "the stream held no output"
    return result


# ---------------------------------------------------------------- a run at one rate


def stats_ms(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"mean": 0.0, "median": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "std": 0.0}
    values = np.asarray(seconds, dtype=np.float64) * 1000
    return {"mean": float(values.mean()), "median": float(np.median(values)),
            "p50": float(np.percentile(values, 50)), "p90": float(np.percentile(values, 90)),
            "p99": float(np.percentile(values, 99)), "std": float(values.std())}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS and/or e2el:MS, got {item!r}")
        slos[name] = float(value)
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the limit must be > 0 ms")
    return slos


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in str(text).split(","):
        rate = float(part.strip())  # "inf" parses too
        if not rate > 0:
            raise ValueError(f"--request-rate values must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    return rates


async def run_at_rate(base_url: str, model: str, prompts: list[list[int]], output_lens: list[int],
                      request_rate: float, max_concurrency: int | None = None, api_key: str | None = None,
                      goodput: dict[str, float] | None = None, seed: int = 0, temperature: float = 0.0,
                      endpoint: str = "/v1/completions") -> dict:
    """Send every prompt (Poisson arrivals at request_rate), wait for all; the run's figures."""
    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = np.random.default_rng(seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    def body(i: int) -> dict:
        return {"model": model, "prompt": prompts[i], "max_tokens": output_lens[i], "temperature": temperature,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def one(session: aiohttp.ClientSession, i: int) -> RequestResult:
        if semaphore is None:
            return await send_completion(session, url, headers, body(i), len(prompts[i]))
        async with semaphore:
            return await send_completion(session, url, headers, body(i), len(prompts[i]))

    async with client_session() as session:
        start = time.perf_counter()
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.ensure_future(one(session, i)))
            if math.isfinite(request_rate) and i + 1 < len(prompts):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results: list[RequestResult] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, request_rate, max_concurrency, goodput or {})


def summarize(results: list[RequestResult], duration: float, request_rate: float, max_concurrency: int | None,
              goodput: dict[str, float]) -> dict:
    done = [r for r in results if r.success]
    tpots = [r.tpot for r in done if r.tpot is not None]
    good = 0
    for r in done:
        ok = (r.ttft * 1000 <= goodput.get("ttft", math.inf)
              and (r.tpot or 0.0) * 1000 <= goodput.get("tpot", math.inf)
              and r.latency * 1000 <= goodput.get("e2el", math.inf))
        good += ok
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "max_concurrency": max_concurrency,
        "num_prompts": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "goodput": good / duration if goodput else None,
        "goodput_slos_ms": goodput or None,
        "ttft_ms": stats_ms([r.ttft for r in done]),
        "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl]),
        "e2e_ms": stats_ms([r.latency for r in done]),
    }


def print_result(result: dict) -> None:
    rows = [("Request rate (req/s)", result["request_rate"]),
            ("Max concurrency", result["max_concurrency"] or "none"),
            ("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
            ("Benchmark duration (s)", f"{result['duration_s']:.2f}"),
            ("Total input tokens", result["total_input_tokens"]),
            ("Total generated tokens", result["total_output_tokens"]),
            ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{result['output_throughput']:.1f}"),
            ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.1f}")]
    if result["goodput"] is not None:
        rows.append(("Request goodput (req/s)", f"{result['goodput']:.2f}"))
    print("{s:=^60}".format(s=" Serving Benchmark Result "))
    for name, value in rows:
        print(f"{name + ':':<44}{value:>16}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        short = key.split("_")[0].upper()
        print("{s:-^60}".format(s=title))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            name = f"{label} {short} (ms):"
            print(f"{name:<44}{result[key][stat]:>16.2f}")
    for error in result["errors"]:
        print(f"error: {error}")
    print("=" * 60, flush=True)


def plot_results(results: list[dict], path: str, title: str = "") -> None:
    """Latency percentiles and output throughput against the request rate (one PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["request_rate"]) for r in results]
    x = np.arange(len(results))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [r[key][stat] for r in results], style, label=stat)
        ax.set_ylabel(name)
        ax.legend()
    axes[2].plot(x, [r["output_throughput"] for r in results], "o-", label="output tok/s")
    axes[2].set_ylabel("output tokens/s")
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def resolve_model(base_url: str, api_key: str | None) -> tuple[str, str | None]:
    """The first model /v1/models lists, and its root (its path, on vLLM and minivllm servers)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with client_session() as session:
        models = (await get_json(session, base_url.rstrip("/") + "/v1/models", headers))["data"]
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"], models[0].get("root")


def vocab_size_of(*candidates: str | None) -> int | None:
    """vocab_size from the config.json of the first candidate that is a local model directory."""
    for path in candidates:
        config = os.path.join(path, "config.json") if path else None
        if config and os.path.isfile(config):
            with open(config) as f:
                data = json.load(f)
            size = data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")
            if size:
                return int(size)
    return None


async def bench_serve(args: argparse.Namespace) -> list[dict]:
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    model, root = args.model, None
    if model is None:
        model, root = await resolve_model(args.base_url, api_key)
    vocab = args.vocab_size or vocab_size_of(args.tokenizer, model, root)
    if vocab is None:
        logger.warning("vocabulary size unknown (give --vocab-size or --tokenizer DIR): drawing token ids "
                       "below %d", DEFAULT_VOCAB)
        vocab = DEFAULT_VOCAB
    workload = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    goodput = parse_goodput(args.goodput)
    rates = parse_rates(args.request_rate)
    # One short request first: a wrong URL, key or model fails here, before anything is measured.
    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with client_session() as session:
        probe = await send_completion(session, url, headers, {
            "model": model, "prompt": workload.prompts[0][:16], "max_tokens": 2, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}, 16)
    if not probe.success:
        raise ValueError(f"the test request to {url} failed: {probe.error}")
    results = []
    for rate in rates:
        result = await run_at_rate(args.base_url, model, workload.prompts, workload.output_lens, rate,
                                   args.max_concurrency, api_key, goodput, args.seed, args.temperature)
        result["model"] = model
        print_result(result)
        results.append(result)
    return results


def cmd_bench_serve(args: argparse.Namespace) -> int:
    results = asyncio.run(bench_serve(args))
    report = {"base_url": args.base_url, "model": results[0]["model"],
              "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                           "output_len": args.output_len, "seed": args.seed, "temperature": args.temperature},
              "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    plot = args.plot
    if plot is None and len(results) > 1 and args.json:
        plot = os.path.splitext(args.json)[0] + ".png"
    if plot:
        try:
            plot_results(results, plot, f"{report['model']}: input {args.input_len}, output {args.output_len}")
        except ImportError as e:
            logger.warning("no plot (%s): pip install matplotlib", e)
    if len(results) > 1:
        print(f"\n{'rate':>6} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
              f"{'TPOT p99':>9} {'ITL p99':>8}")
        for r in results:
            print(f"{r['request_rate']:>6} {r['request_throughput']:>8.2f} {r['output_throughput']:>10.1f} "
                  f"{r['ttft_ms']['p50']:>9.1f} {r['ttft_ms']['p99']:>9.1f} {r['tpot_ms']['p50']:>9.2f} "
                  f"{r['tpot_ms']['p99']:>9.2f} {r['itl_ms']['p99']:>8.2f}")
    return 0 if all(r["completed"] for r in results) else 1


def add_bench_serve_parser(kinds: argparse._SubParsersAction) -> None:
    sv = kinds.add_parser("serve", help="load an OpenAI-compatible server (minivllm serve, vllm serve) with "
                          "streamed requests at a request rate", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sv.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's base URL")
    sv.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    sv.add_argument("--tokenizer", default=None, help="local model dir whose config.json gives the vocabulary size")
    sv.add_argument("--vocab-size", type=int, default=None,
                    help="draw random prompt token ids below this (default: from the model's config.json when the "
                         f"model is a local directory, else {DEFAULT_VOCAB})")
    sv.add_argument("--num-prompts", type=int, default=256)
    sv.add_argument("--input-len", default="100:1024", help="prompt length N or range LO:HI (uniform)")
    sv.add_argument("--output-len", default="256", help="output length N or range LO:HI (uniform); EOS ignored")
    sv.add_argument("--request-rate", default="inf",
                    help="requests/s of the Poisson arrivals, or inf (all at once); comma-separated for a sweep")
    sv.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    sv.add_argument("--goodput", nargs="+", default=None, metavar="SLO",
                    help="SLOs for goodput, in ms: ttft:MS tpot:MS e2el:MS")
    sv.add_argument("--temperature", type=float, default=0.0)
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY)")
    sv.add_argument("--json", default=None, help="save the results to this file")
    sv.add_argument("--plot", default=None,
                    help="PNG of latency and throughput against rate (default with several rates and --json: "
                         "the JSON's name with .png)")
    sv.set_defaults(func=cmd_bench_serve)
