"""Build the model from a HF directory and fill its weights.

load_format:
  auto / safetensors  stream every tensor of every *.safetensors file in the directory onto
                      the model's parameters (slicing q/k/v and gate/up into the fused ones);
                      under tensor parallelism each rank reads only its shard's rows/columns
                      from the file (safetensors `get_slice`)
  dummy               small uniform random weights, from config.json alone (benchmarks)

Under pipeline parallelism a stage builds only its own layers (and the embedding / norm / LM head
if they are its), and the checkpoint tensors of the other stages' modules are skipped unread.

In fp32 on the CPU (and in bf16 where the CPU has oneDNN's bf16 kernels) the loaded projections
are then packed for oneDNN (worker/cpu_gemm.py), unless MINIVLLM_CPU_PACKED_GEMM=0.
"""

from __future__ import annotations

import glob
import logging
import os
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from minivllm.protocol.config import EngineConfig
from minivllm.worker import cpu_gemm
from minivllm.worker.attention.metadata import AttentionBackend
from minivllm.worker.models.llama import LlamaForCausalLM
from minivllm.worker.models.parallel_layers import ColumnParallelLinear, Loadable, loaded_shape

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
CPU_PACKED_GEMM_ENV = "MINIVLLM_CPU_PACKED_GEMM"  # "0": plain F.linear on the CPU

# Checkpoint tensors that are not weights of ours (old checkpoints store RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def model_hf_config(config: EngineConfig) -> Any:
    """The model's HF config: the copy the frontend resolved (attributes of a namespace: no
    transformers import in this process), else config.json read through transformers."""
    if config.hf_config is not None:
        return SimpleNamespace(**config.hf_config)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config.model)


def load_model(
    config: EngineConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    attn_backend: AttentionBackend | None = None,
) -> LlamaForCausalLM:
    """Build the model described by config.model's config.json on `device` in `dtype`, load weights."""
    hf_config = model_hf_config(config)
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {hf_config.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(hf_config, "sliding_window", None) and hf_config.sliding_window < config.max_model_len and (
        hf_config.model_type == "mistral" or getattr(hf_config, "use_sliding_window", False)
    ):
        logger.warning("sliding_window=%d is ignored: attention is full-context", hf_config.sliding_window)
    if attn_backend is None:
        from minivllm.worker.attention.reference import ReferenceAttentionBackend

        attn_backend = ReferenceAttentionBackend()

    device = torch.device(device)
    # Construct directly on the target device in the target dtype (no fp32 CPU copy first).
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_config, attn_backend, max_position=config.max_model_len)
    finally:
        torch.set_default_dtype(previous_dtype)

    if config.load_format == "dummy":
        load_dummy_weights(model, seed=config.seed)
    elif config.load_format in ("auto", "safetensors"):
        load_safetensors_weights(model, config.model)
    else:
        raise ValueError(f"unknown load_format {config.load_format!r}")
    if cpu_gemm.packs(next(model.parameters())) and os.environ.get(CPU_PACKED_GEMM_ENV, "1") != "0":
        model.pack_for_cpu()
    return model.eval()


@torch.no_grad()
def load_safetensors_weights(model: LlamaForCausalLM, model_dir: str) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter; fail on gaps."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")

    params = dict(model.named_parameters())
    # Every (param name, shard) we expect to be filled; fused params count once per shard.
    missing: set[tuple[str, str | None]] = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{param_name}"
            if isinstance(module, ColumnParallelLinear):
                missing.update((full_name, shard) for shard in module.shard_slices)
            else:
                missing.add((full_name, None))

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and model.tie_word_embeddings:
                    continue  # some tied checkpoints store a copy anyway
                if not _on_this_stage(model, name):
                    continue  # another pipeline stage's weight
                # A lazy handle: the layer indexes out its shard, and only that is read.
                missing.discard(_load_one(model, params, name, f.get_slice(name)))

    if missing:
        names = sorted(f"{n}[{s}]" if s else n for n, s in missing)
        more = f" and {len(names) - 10} more" if len(names) > 10 else ""
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(names[:10])}{more}")
    logger.info("loaded %d safetensors file(s) from %s", len(files), model_dir)


def _on_this_stage(model: LlamaForCausalLM, name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to a module this pipeline stage holds."""
    inner = model.model
    if name.startswith("model.layers."):
        index = int(name.split(".", 3)[2])
        return inner.start_layer <= index < inner.end_layer
    if name.startswith("model.embed_tokens."):
        return inner.embed_tokens is not None
    if name.startswith("model.norm."):
        return inner.norm is not None
    if name.startswith("lm_head."):
        return model.lm_head is not None
    return True


def _load_one(
    model: LlamaForCausalLM, params: dict[str, nn.Parameter], name: str, loaded: Loadable
) -> tuple[str, str | None]:
    """Load checkpoint tensor `name` (a tensor or a safetensors slice); return the (param, shard)
    key it filled. Sharded layers take their part through their `load_weight`."""
    module_path, _, param_name = name.rpartition(".")
    parent, _, proj = module_path.rpartition(".")
    if proj in model.packed_modules:
        fused_name, shard_id = model.packed_modules[proj]
        fused: ColumnParallelLinear = model.get_submodule(f"{parent}.{fused_name}")
        fused.load_weight(param_name, loaded, shard_id)
        return f"{parent}.{fused_name}.{param_name}", shard_id
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} {loaded_shape(loaded)} has no matching parameter")
    module = model.get_submodule(module_path)
    if hasattr(module, "load_weight"):
        module.load_weight(param_name, loaded)
        return name, None
    param = params[name]  # replicated: every rank takes all of it
    if tuple(param.shape) != loaded_shape(loaded):
        raise ValueError(f"{name}: model expects {tuple(param.shape)}, checkpoint has {loaded_shape(loaded)}")
    param.copy_(loaded[:])
    return name, None


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int, low: float = -1e-3, high: float = 1e-3) -> None:
    """Fill every parameter with small uniform noise (as vLLM's dummy loader), reproducibly.

    Drawn in place on the parameter's device: a multi-GB model must not go through the CPU.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for _, param in sorted(model.named_parameters()):
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.uniform_(low, high, generator=generators[param.device])


def describe(model: LlamaForCausalLM) -> dict[str, Any]:
    """A few facts about the built model, for logs."""
    return {
        "layers": model.num_layers,
        "kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "params": sum(p.numel() for p in model.parameters()),
    }
