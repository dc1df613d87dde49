"""EngineConfig: the resolved settings every process shares. Built once from the user's arguments
(and the model's config.json, read through transformers), then sent to the EngineCore and workers
as msgpack."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec


def cache_root() -> Path:
    """minivllm's on-disk cache, shared by its processes (converted models, built CPU kernels):
    `$MINIVLLM_CACHE`, or `~/.cache/minivllm`."""
    return Path(os.environ.get("MINIVLLM_CACHE") or Path.home() / ".cache" / "minivllm").expanduser()


DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# fcfs: first come first served. priority: lowest `priority` value first, ties by arrival.
# v0: the pre-V1 two-phase scheduler (a step is all whole-prompt prefills or all decodes).
SCHEDULING_POLICIES = ("fcfs", "priority", "v0")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# On a GPU a step of a few thousand tokens costs little more than one of 2048 (the weights are read
# once either way), and fewer, fuller steps finish prompts sooner: vLLM's offline default is larger too.
DEFAULT_GPU_MAX_NUM_BATCHED_TOKENS = 8192
# vLLM's usage contexts: the offline LLM class, the OpenAI server, an engine used directly.
USAGE_CONTEXTS = ("LLM_CLASS", "OPENAI_API_SERVER", "ENGINE_CONTEXT")
# As vLLM: the LLM class takes a larger budget on GPUs of at least 70 GiB that are not A100s (H100,
# H200, MI300X; on an A100 a large budget cost throughput, vLLM PR 17885). On an H100 a fresh
# 32,000-token prompt then reaches its first token in two steps instead of four (258 against 266 ms),
# and the 256-request workload runs as fast (benchmarks/RESULTS.md).
LARGE_GPU_LLM_MAX_NUM_BATCHED_TOKENS = 16384
LARGE_GPU_MIN_BYTES = 70 * 2**30
DEFAULT_MAX_PENDING_REQUESTS = 4096
# Step watchdog: seconds the workers may take to answer one step before the engine declares them
# hung (vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS has the same default).
DEFAULT_EXECUTE_MODEL_TIMEOUT_S = 300.0
# KV cache element type (vLLM's kv_cache_dtype): auto = the model's dtype; fp8 and fp8_e4m3 (the
# same) = e4m3 with a scale per token and KV head (worker/attention/kv_cache.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# Bytes of one such scale (a bfloat16): the block size in bytes depends on it, on the host too.
FP8_SCALE_BYTES = 2
# What a preempted request's KV becomes: recomputed later, or swapped to host memory and back
# (needs kv_offloading_size). None: recompute (vLLM's default).
PREEMPTION_MODES = ("recompute", "swap")
# How workers are started and placed: mp (local processes), ray (actors), or uni (one worker
# inside the EngineCore process; one device only).
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray", "uni")
# KV connector roles (vLLM's KVTransferConfig.kv_role).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Speculative decoding proposers (vLLM's speculative_config["method"]).
SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_NUM_SPECULATIVE_TOKENS = 16  # more drafts per step than this are almost never accepted in a row
# vLLM's prompt lookup default when neither bound is given: 5-grams; one bound alone sets both.
DEFAULT_PROMPT_LOOKUP = 5
MAX_PROMPT_LOOKUP = 64
# Speculation steps aside above this many running requests: a verify step runs k+1 tokens per
# request and is step-synchronous, and past some batch size that costs more than the accepted
# drafts save. Measured (H100, SmolLM2, n-gram k=4, ~76% acceptance; benchmarks/RESULTS.md):
# 1.30x faster per token at 16 requests, 0.95x at 32, 0.71x at 64.
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 16


class KVTransferConfig(msgspec.Struct, kw_only=True):
    """vLLM's KVTransferConfig: which KV connector moves KV in or out of this engine, and its role
    (producer: a prefill instance; consumer: a decode instance; both)."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict = {}


class SpeculativeConfig(msgspec.Struct, kw_only=True):
    """vLLM's speculative_config: how draft tokens are proposed and how many per step.
    ngram: prompt lookup (the last prompt_lookup_min..max tokens matched earlier in the sequence);
    draft_model: a smaller model (`model`, a directory) run in the same worker with its own KV."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    # Speculate only while at most this many requests run (vLLM's old name); None: the default,
    # DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE. Above it a verify step costs more than it saves.
    disable_by_batch_size: int | None = None

    @property
    def max_speculating_batch(self) -> int:
        """The most running requests at which speculation still runs."""
        return self.disable_by_batch_size or DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE


class EngineConfig(msgspec.Struct, kw_only=True):
    # model
    model: str
    tokenizer: str
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    load_format: str = "auto"  # dummy: random weights from config.json alone
    # The model's config.json as transformers resolved it in the frontend (defaults filled in), so
    # the workers need not import transformers (~1.5 s of every start); None: they read it.
    hf_config: dict[str, Any] | None = None
    seed: int = 0
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int] = []
    # KV cache
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: the worker sizes the cache itself
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory weights + activations + KV may use
    # execution
    enforce_eager: bool = False  # True: no CUDA graphs
    # scheduler
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"  # one of SCHEDULING_POLICIES
    # Most tokens one request may prefill in one step (0: no cap beyond the step's budget), so a
    # long prompt cannot take a whole step from the others.
    long_prefill_token_threshold: int = 0
    # Reuse the KV blocks of identical prompt prefixes across requests.
    enable_prefix_caching: bool = True
    # Schedule step N+1 while the workers run step N (the scheduler counts each sampling request's
    # next token as a placeholder until it arrives), so the EngineCore's own work and the socket
    # round trip hide behind the GPU. Outputs are the same either way.
    async_scheduling: bool = True
    # parallelism
    tensor_parallel_size: int = 1
    # admission: most requests the engine holds (running + waiting) before it refuses new ones as
    # overloaded, so a flood cannot grow its queues (and memory) without bound
    max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS
    # step watchdog: a step the workers do not answer within this many seconds makes the engine
    # dead (EngineDeadError with the reason) instead of a silent hang
    execute_model_timeout_seconds: float = DEFAULT_EXECUTE_MODEL_TIMEOUT_S

    # --- KV cache precision (speed issue) ---
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    # --- KV transfer: CPU offload tier, swap preemption, PD disaggregation ---
    kv_offloading_size: float | None = None  # GiB of pinned host memory for evicted / swapped KV
    preemption_mode: str | None = None  # one of PREEMPTION_MODES; None: recompute
    kv_transfer_config: KVTransferConfig | None = None

    # --- distributed execution ---
    distributed_executor_backend: str = "mp"  # one of DISTRIBUTED_EXECUTOR_BACKENDS
    data_parallel_size: int = 1  # engine cores behind one frontend, each with its own TP group
    pipeline_parallel_size: int = 1  # layer stages, each a TP group, with several batches in flight

    # --- speculative decoding ---
    speculative_config: SpeculativeConfig | None = None

    @classmethod
    def create(
        cls,
        model: str,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        load_format: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_gpu_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 256,
        tensor_parallel_size: int = 1,
        scheduling_policy: str = "fcfs",
        long_prefill_token_threshold: int = 0,
        enable_prefix_caching: bool = True,
        async_scheduling: bool = True,
        max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
        execute_model_timeout_seconds: float = DEFAULT_EXECUTE_MODEL_TIMEOUT_S,
        kv_cache_dtype: str = "auto",
        kv_offloading_size: float | None = None,
        preemption_mode: str | None = None,
        kv_transfer_config: KVTransferConfig | dict | None = None,
        distributed_executor_backend: str = "mp",
        data_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        speculative_config: SpeculativeConfig | dict | None = None,
        usage_context: str = "ENGINE_CONTEXT",
    ) -> "EngineConfig":
        """Validate the user's arguments and fill in what the model's config decides. usage_context
        (vLLM's): who runs the engine, which picks max_num_batched_tokens' default."""
        if not os.path.isdir(model):
            raise ValueError(f"model must be a directory holding config.json, got {model!r}.")
        _check_choice("dtype", dtype, DTYPES)
        _check_choice("device", device, DEVICES)
        _check_choice("load_format", load_format, LOAD_FORMATS)
        _check_choice("usage_context", usage_context, USAGE_CONTEXTS)
        _check_at_least("block_size", block_size, 1)
        if max_num_batched_tokens is not None:
            _check_at_least("max_num_batched_tokens", max_num_batched_tokens, 1)
        _check_at_least("max_num_seqs", max_num_seqs, 1)
        _check_choice("scheduling_policy", scheduling_policy, SCHEDULING_POLICIES)
        _check_at_least("long_prefill_token_threshold", long_prefill_token_threshold, 0)
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}.")
        if not isinstance(async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {async_scheduling!r}.")
        if scheduling_policy == "v0" and long_prefill_token_threshold:
            raise ValueError("long_prefill_token_threshold caps prefill chunks, but scheduling_policy='v0' "
                             "schedules whole prompts; leave it at 0 or use 'fcfs' / 'priority'.")
        _check_at_least("tensor_parallel_size", tensor_parallel_size, 1)
        _check_at_least("max_pending_requests", max_pending_requests, 1)
        if (isinstance(execute_model_timeout_seconds, bool) or not isinstance(execute_model_timeout_seconds, (int, float))
                or not execute_model_timeout_seconds > 0):
            raise ValueError(f"execute_model_timeout_seconds must be a number > 0, got {execute_model_timeout_seconds!r}.")
        if num_gpu_blocks is not None:
            _check_at_least("num_gpu_blocks", num_gpu_blocks, 1)
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}.")

        _check_kv_cache_dtype(kv_cache_dtype)

        kv_transfer_config = _check_kv_transfer(kv_offloading_size, preemption_mode, kv_transfer_config)

        _check_distributed(distributed_executor_backend, data_parallel_size, tensor_parallel_size, device)
        _check_at_least("pipeline_parallel_size", pipeline_parallel_size, 1)
        if distributed_executor_backend == "uni" and tensor_parallel_size * pipeline_parallel_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs the model inside the engine process, on one device; "
                f"tensor_parallel_size={tensor_parallel_size} x pipeline_parallel_size={pipeline_parallel_size} "
                f"needs a worker per device: use 'mp' or 'ray'.")
        speculative_config = _check_speculative(speculative_config, model, tensor_parallel_size, pipeline_parallel_size,
                                                 kv_transfer_config)

        from transformers import AutoConfig  # lazy: only the process that builds configs pays

        hf_config = AutoConfig.from_pretrained(model)
        derived_len = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        if max_model_len is None:
            if derived_len <= 0:
                raise ValueError("the model's config has no max_position_embeddings; pass max_model_len.")
            max_model_len = derived_len
        _check_at_least("max_model_len", max_model_len, 1)
        if derived_len and max_model_len > derived_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's maximum length "
                f"({derived_len}); use a value in [1, {derived_len}]."
            )
        _check_tensor_parallel_size(tensor_parallel_size, hf_config, device, distributed_executor_backend)
        _check_pipeline_parallel(pipeline_parallel_size, hf_config, tensor_parallel_size, data_parallel_size,
                                 kv_transfer_config is not None or kv_offloading_size is not None, device,
                                 distributed_executor_backend)
        on_cuda = runs_on_cuda(device)
        # (the GPU is asked only where its answer could matter)
        gpu = first_gpu() if on_cuda and usage_context == "LLM_CLASS" and max_num_batched_tokens is None else None
        default_budget = default_max_num_batched_tokens(on_cuda, usage_context, gpu)
        if scheduling_policy == "v0":
            # V0 prefills whole prompts, so one step must hold the longest one (vLLM V0's rule);
            # by default the budget grows to fit.
            if max_num_batched_tokens is None:
                max_num_batched_tokens = max(default_budget, max_model_len)
            elif max_num_batched_tokens < max_model_len:
                raise ValueError(
                    f"scheduling_policy='v0' prefills whole prompts, so max_num_batched_tokens "
                    f"({max_num_batched_tokens}) must be >= max_model_len ({max_model_len}); raise "
                    f"max_num_batched_tokens, lower max_model_len, or use 'fcfs' (chunked prefill)."
                )
        elif max_num_batched_tokens is None:
            max_num_batched_tokens = default_budget
        return cls(
            model=os.path.abspath(model),
            tokenizer=os.path.abspath(tokenizer or model),
            dtype=dtype,
            device=device,
            load_format=load_format,
            seed=seed,
            max_model_len=max_model_len,
            vocab_size=int(hf_config.vocab_size),
            eos_token_ids=_eos_token_ids(model, hf_config),
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size,
            scheduling_policy=scheduling_policy,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_prefix_caching=enable_prefix_caching,
            async_scheduling=async_scheduling,
            max_pending_requests=max_pending_requests,
            execute_model_timeout_seconds=float(execute_model_timeout_seconds),
            kv_cache_dtype=kv_cache_dtype,
            kv_offloading_size=None if kv_offloading_size is None else float(kv_offloading_size),
            preemption_mode=preemption_mode,
            kv_transfer_config=kv_transfer_config,
            distributed_executor_backend=distributed_executor_backend,
            data_parallel_size=data_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            speculative_config=speculative_config,
            hf_config=json.loads(hf_config.to_json_string(use_diff=False)),
        )


def _check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    _check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)


def _check_kv_transfer(kv_offloading_size: float | None, preemption_mode: str | None,
                       kv_transfer_config: KVTransferConfig | dict | None) -> KVTransferConfig | None:
    """Validate the KV transfer settings; a dict kv_transfer_config (as from JSON) becomes a KVTransferConfig.

    kv_offloading_size alone turns on the CPU offload tier (internally the OffloadingConnector);
    preemption_mode="swap" swaps preempted requests' KV into that tier. kv_transfer_config selects
    a KV connector by name (protocol/kv_transfer.py KV_CONNECTORS); one connector at a time."""
    from minivllm.protocol.kv_transfer import KV_CONNECTORS, OFFLOADING_CONNECTOR

    if kv_offloading_size is not None:
        if isinstance(kv_offloading_size, bool) or not isinstance(kv_offloading_size, (int, float)) \
                or not kv_offloading_size > 0:
            raise ValueError(f"kv_offloading_size (GiB of host memory for the CPU KV tier) must be a number > 0, "
                             f"got {kv_offloading_size!r}.")
        total_gib = _host_memory_gib()
        if total_gib is not None and kv_offloading_size > total_gib:
            raise ValueError(f"kv_offloading_size={kv_offloading_size:g} GiB is more than this host's memory "
                             f"({total_gib:.1f} GiB); use a value in (0, {total_gib:.1f}].")
    if preemption_mode is not None:
        _check_choice("preemption_mode", preemption_mode, PREEMPTION_MODES)
        if preemption_mode == "swap" and kv_offloading_size is None:
            raise ValueError("preemption_mode='swap' moves preempted KV to host memory: set kv_offloading_size "
                             "(GiB of host memory) too, or use 'recompute'.")
    if kv_transfer_config is None:
        return None
    if isinstance(kv_transfer_config, dict):
        try:
            kv_transfer_config = msgspec.convert(kv_transfer_config, KVTransferConfig)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid kv_transfer_config: {e}") from None
    elif not isinstance(kv_transfer_config, KVTransferConfig):
        raise ValueError(f"kv_transfer_config must be a KVTransferConfig or a dict, got {type(kv_transfer_config).__name__}.")
    if kv_transfer_config.kv_connector not in KV_CONNECTORS:
        raise ValueError(f"kv_transfer_config.kv_connector must be one of {', '.join(sorted(KV_CONNECTORS))}; "
                         f"got {kv_transfer_config.kv_connector!r}.")
    _check_choice("kv_transfer_config.kv_role", kv_transfer_config.kv_role, KV_ROLES)
    if not 1 <= kv_transfer_config.kv_port <= 65535:
        raise ValueError(f"kv_transfer_config.kv_port must be in [1, 65535], got {kv_transfer_config.kv_port}.")
    timeout = kv_transfer_config.kv_connector_extra_config.get("transfer_timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"kv_connector_extra_config['transfer_timeout_s'] must be a number > 0 (seconds), got {timeout!r}.")
    if kv_transfer_config.kv_connector == OFFLOADING_CONNECTOR:
        if kv_offloading_size is None:
            raise ValueError(f"{OFFLOADING_CONNECTOR} needs kv_offloading_size (GiB of host memory); set it "
                             "(it alone selects the connector, kv_transfer_config is not needed).")
    elif kv_offloading_size is not None:
        raise ValueError(f"kv_offloading_size (the CPU offload tier) and kv_transfer_config "
                         f"({kv_transfer_config.kv_connector}) each need a KV connector, and one engine runs one; "
                         "unset one of them.")
    return kv_transfer_config


def _host_memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (AttributeError, ValueError, OSError):
        return None


def _check_distributed(distributed_executor_backend: str, data_parallel_size: int, tensor_parallel_size: int = 1,
                       device: str = "auto") -> None:
    """mp: every engine core and worker on this host (on CUDA, data_parallel_size x
    tensor_parallel_size devices); uni: the same, each engine core its own worker. ray: Ray places
    the workers, so the devices are counted in the cluster when the placement group is made, not
    here; Ray must be installed."""
    _check_choice("distributed_executor_backend", distributed_executor_backend, DISTRIBUTED_EXECUTOR_BACKENDS)
    _check_at_least("data_parallel_size", data_parallel_size, 1)
    if distributed_executor_backend == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend='ray' needs Ray: `pip install ray` (or "
                             "`pip install minivllm[ray]`) on every node, or use 'mp'.")
    elif data_parallel_size > 1 and runs_on_cuda(device):
        _check_visible_devices(f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tensor_parallel_size}",
                               data_parallel_size * tensor_parallel_size)


def _check_visible_devices(what: str, needed: int) -> None:
    """mp on CUDA: every rank takes a device of those this process sees."""
    import torch

    visible = torch.cuda.device_count()
    if needed > visible:
        raise ValueError(f"{what} needs {needed} CUDA devices, but {visible} are visible (CUDA_VISIBLE_DEVICES); lower "
                         "one of them, or use distributed_executor_backend='ray' to span several machines.")


def _check_pipeline_parallel(size: int, hf_config, tensor_parallel_size: int, data_parallel_size: int,
                             kv_connector: bool, device: str, backend: str) -> None:
    """Pipeline parallelism: the layers split into `size` stages of tensor_parallel_size ranks each.
    Every stage needs at least one layer; on mp + CUDA every rank needs its own visible device."""
    _check_at_least("pipeline_parallel_size", size, 1)
    if size == 1:
        return
    num_layers = int(hf_config.num_hidden_layers)
    if size > num_layers:
        raise ValueError(f"pipeline_parallel_size={size} exceeds the model's {num_layers} layers (each stage needs "
                         f"at least one); use a value in [1, {num_layers}].")
    if data_parallel_size > 1:
        raise ValueError("pipeline_parallel_size > 1 with data_parallel_size > 1 is not supported; use one of them.")
    if kv_connector:
        raise ValueError("pipeline_parallel_size > 1 with a KV connector (kv_transfer_config, kv_offloading_size, "
                         "preemption_mode='swap') is not supported; use pipeline_parallel_size=1.")
    if backend == "mp" and runs_on_cuda(device):  # ray: the cluster's GPUs count
        _check_visible_devices(f"pipeline_parallel_size={size} x tensor_parallel_size={tensor_parallel_size}",
                               size * tensor_parallel_size)


def _check_speculative(speculative_config: SpeculativeConfig | dict | None, model: str = "",
                       tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                       kv_transfer_config: KVTransferConfig | None = None) -> SpeculativeConfig | None:
    """A dict speculative_config (as from JSON or vLLM's LLM(...)) becomes a SpeculativeConfig, with
    its ranges checked and vLLM's defaults filled in (prompt lookup bounds)."""
    if speculative_config is None:
        return None
    if isinstance(speculative_config, dict):
        unknown = sorted(set(speculative_config) - set(SpeculativeConfig.__struct_fields__))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                             f"{', '.join(SpeculativeConfig.__struct_fields__)}.")
        try:
            speculative_config = msgspec.convert(speculative_config, SpeculativeConfig)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid speculative_config: {e}") from None
    elif not isinstance(speculative_config, SpeculativeConfig):
        raise ValueError(f"speculative_config must be a dict or a SpeculativeConfig, got "
                         f"{type(speculative_config).__name__}.")
    spec = speculative_config
    _check_choice("speculative_config['method']", spec.method, SPECULATIVE_METHODS)
    k = spec.num_speculative_tokens
    if isinstance(k, bool) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative_config['num_speculative_tokens'] must be an integer in "
                         f"[1, {MAX_NUM_SPECULATIVE_TOKENS}], got {k!r}.")
    if spec.disable_by_batch_size is not None:
        _check_at_least("speculative_config['disable_by_batch_size']", spec.disable_by_batch_size, 1)
    if pipeline_parallel_size > 1:
        raise ValueError("speculative decoding with pipeline_parallel_size > 1 is not supported; use one or the other.")
    if kv_transfer_config is not None:
        raise ValueError("speculative decoding with a KV connector (kv_transfer_config / kv_offloading_size) is not "
                         "supported yet; use one or the other.")
    if spec.method == "ngram":
        if spec.model is not None:
            raise ValueError("speculative_config['model'] is for method 'draft_model'; 'ngram' proposes from the "
                             "request's own tokens.")
        low, high = spec.prompt_lookup_min, spec.prompt_lookup_max
        # As vLLM: neither bound given means 5-grams; one bound alone sets the other to it.
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        elif low is None:
            low = high
        elif high is None:
            high = low
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PROMPT_LOOKUP:
                raise ValueError(f"speculative_config['{name}'] must be an integer in [1, {MAX_PROMPT_LOOKUP}], "
                                 f"got {value!r}.")
        if low > high:
            raise ValueError(f"speculative_config['prompt_lookup_min'] ({low}) must be <= prompt_lookup_max ({high}).")
        spec.prompt_lookup_min, spec.prompt_lookup_max = low, high
        return spec
    # draft_model
    if spec.prompt_lookup_min is not None or spec.prompt_lookup_max is not None:
        raise ValueError("speculative_config['prompt_lookup_min'/'prompt_lookup_max'] are for method 'ngram'.")
    if tensor_parallel_size > 1:
        raise ValueError("speculative decoding with a draft model and tensor_parallel_size > 1 is not supported yet; "
                         "use method 'ngram' or tensor_parallel_size=1.")
    draft = spec.model
    if not isinstance(draft, str) or not os.path.isfile(os.path.join(draft, "config.json")):
        raise ValueError("speculative_config['model'] must be a directory holding config.json (the draft model) "
                         f"for method 'draft_model', got {draft!r}.")
    import json

    def vocab_size(directory: str) -> int | None:
        try:
            with open(os.path.join(directory, "config.json")) as f:
                return int(json.load(f).get("vocab_size"))
        except (OSError, ValueError, TypeError):
            return None

    draft_vocab, target_vocab = vocab_size(draft), vocab_size(model) if model else None
    if draft_vocab is None:
        raise ValueError(f"the draft model's config.json ({draft}) has no readable vocab_size.")
    if target_vocab is not None and draft_vocab != target_vocab:
        raise ValueError(f"the draft model's vocab_size ({draft_vocab}) differs from the target model's "
                         f"({target_vocab}); a draft model must share the target's tokenizer and vocabulary.")
    spec.model = os.path.abspath(draft)
    return spec


def _check_tensor_parallel_size(size: int, hf_config, device: str, backend: str = "mp") -> None:
    """The model must split evenly over `size` ranks (query heads, MLP width; KV heads split or,
    when fewer than the ranks, are replicated), and on CUDA each rank needs its own device."""
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    intermediate = int(hf_config.intermediate_size)
    allowed = [n for n in range(1, heads + 1)
               if heads % n == 0 and intermediate % n == 0 and (kv_heads % n == 0 if n <= kv_heads else n % kv_heads == 0)]
    if size not in allowed:
        raise ValueError(
            f"tensor_parallel_size={size} does not split this model ({heads} attention heads, {kv_heads} KV "
            f"heads, intermediate_size {intermediate}); use one of {', '.join(map(str, allowed))}."
        )
    if size > 1 and backend == "mp" and runs_on_cuda(device):  # ray: the cluster's GPUs count
        import torch

        visible = torch.cuda.device_count()
        if size > visible:
            raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices, but {visible} are visible "
                             f"(CUDA_VISIBLE_DEVICES); use a value in [1, {visible}].")


def default_max_num_batched_tokens(on_cuda: bool, usage_context: str, gpu: tuple[int, str] | None) -> int:
    """The step budget when none is given: vLLM's for the usage context and the GPU (gpu: its total
    memory in bytes and its name; None when unknown, which takes the smaller default, as vLLM does)."""
    if not on_cuda:
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    if usage_context == "LLM_CLASS" and gpu is not None:
        total_memory, name = gpu
        if total_memory >= LARGE_GPU_MIN_BYTES and "a100" not in name.lower():
            return LARGE_GPU_LLM_MAX_NUM_BATCHED_TOKENS
    return DEFAULT_GPU_MAX_NUM_BATCHED_TOKENS


def first_gpu() -> tuple[int, str] | None:
    """CUDA device 0's total memory (bytes) and name, or None where torch or CUDA is missing. Asking
    makes no CUDA context, but torch then counts CUDA as initialized in this process, so a child
    forked from it may not use CUDA; the engine's processes are started with exec, not forked."""
    try:
        import torch

        properties = torch.cuda.get_device_properties(0)
    except Exception:  # no torch, no CUDA, no device 0
        return None
    return properties.total_memory, properties.name


def runs_on_cuda(device: str) -> bool:
    """Whether the workers will run on CUDA (device "auto" asks torch, only if it is installed here)."""
    if device != "auto":
        return device == "cuda"
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _eos_token_ids(model: str, hf_config) -> list[int]:
    """EOS ids from config.json and generation_config.json (Llama 3 lists several)."""
    from transformers import GenerationConfig

    ids: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None)]
    try:
        sources.append(GenerationConfig.from_pretrained(model).eos_token_id)
    except OSError:  # no generation_config.json
        pass
    for value in sources:
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return ids


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}.")


def _check_at_least(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
