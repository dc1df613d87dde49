"""One Llama-family decoder: Llama 2/3, Mistral, Qwen2, Qwen3.

The differences between these are config switches:
  - GQA: num_key_value_heads < num_attention_heads
  - q/k/v bias: `attention_bias` (Llama/Qwen3 configs) or always on (Qwen2)
  - per-head q/k RMSNorm before RoPE (Qwen3)
  - RoPE variants (default, linear, Llama-3, YaRN...) via transformers' ROPE_INIT_FUNCTIONS
  - tied input/output embeddings, `mlp_bias`, head_dim from config or hidden / heads

The model runs on flat packed tokens (no batch dimension, no padding): a step's prefill
chunks and decodes are concatenated, and attention metadata says which rows belong to which
sequence. q/k/v are one `qkv_proj` and gate/up one `gate_up_proj` (fewer, larger matmuls);
the loader slices HF's separate checkpoint tensors into them.

Tensor parallelism (worker/models/parallel_layers.py): qkv_proj and gate_up_proj are
column-parallel, o_proj and down_proj row-parallel (one all-reduce per attention and per MLP),
the embedding and LM head vocab-parallel. Each rank runs num_heads / tp query heads and
num_kv_heads / tp KV heads; with fewer KV heads than ranks, each KV head is replicated on
tp / num_kv_heads ranks (the ones whose query heads read it).

Pipeline parallelism (worker/distributed.py): a stage builds only its layers [start, end) (the
others are parameterless placeholders, so parameter names stay the checkpoint's), the embedding
only on the first stage, the final norm and LM head only on the last (which also keeps the
embedding when it is tied to the LM head). A stage other than the first takes the previous
stage's (hidden states, residual); one other than the last returns them instead of the normed output.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from minivllm.worker import cpu_gemm, hopper_gemm, ops
from minivllm.worker.attention.metadata import AttentionBackend, AttentionMetadata, RopeInputs
from minivllm.worker.distributed import get_tp_rank, get_tp_world_size, is_first_stage, is_last_stage, pp_layer_range
from minivllm.worker.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    divide,
    vocab_parallel_logits,
)
from minivllm.worker.output_rows import OutputRows

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """x / rms(x) * weight, statistics in fp32 (as HF does). Given a residual, it first adds x to
    it and returns the sum too: the pre-norm block's "x + sublayer" fused into the next norm."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out, summed = ops.add_rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, summed)


# ---------------------------------------------------------------- rotary position embedding


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE settings as one dict with `rope_type` and `rope_theta`.

    transformers 5 keeps them in `config.rope_parameters`; transformers 4 in `config.rope_theta`
    plus an optional `config.rope_scaling` dict (whose type key was once called "type").
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    if "rope_theta" not in params:
        # transformers 4 keeps theta beside rope_scaling; 10000 is what its Llama config defaults to.
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def rope_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] (fp32) and the attention scaling applied to cos/sin."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = float(params["rope_theta"])
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        return 1.0 / (base**exponent), 1.0
    if rope_type in ("dynamic", "longrope"):
        # These rescale with the running sequence length; we use the initial frequencies.
        logger.warning("rope_type %r is treated as static (initial frequencies only)", rope_type)
    from transformers import AutoConfig, PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not isinstance(hf_config, PretrainedConfig):  # the frontend's resolved copy (loader.model_hf_config)
        settings = dict(vars(hf_config))
        hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.cpu().float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """Rotates q/k by position-dependent angles (RoFormer, "rotate half" / GPT-NeoX layout).

    cos/sin for every position up to max_position are precomputed in fp32; a step just
    indexes them by each token's position.
    """

    def __init__(self, hf_config: Any, head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(hf_config, head_dim)
        self.rotary_dim = 2 * inv_freq.shape[0]
        # Computed on CPU in fp32 whatever the model's device/dtype, then moved where the model
        # is being built (the loader builds it under a `with torch.device(...)` context).
        positions = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, rotary_dim // 2]
        device = torch.get_default_device()
        self.register_buffer("cos_cache", (freqs.cos() * attention_scaling).to(device), persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * attention_scaling).to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
        q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, kv_store: tuple | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [tokens, heads, head_dim] and k by their positions; with q_norm/k_norm
        (Qwen3), normalize each head first; with kv_store, write k and v to the cache after
        (ops.norm_rope). One kernel on CUDA."""
        if q_norm is None:
            return ops.norm_rope(query, key, positions, self.cos_cache, self.sin_cache, kv_store=kv_store)
        return ops.norm_rope(query, key, positions, self.cos_cache, self.sin_cache,
                             q_norm.weight, k_norm.weight, q_norm.eps, kv_store=kv_store)


# ---------------------------------------------------------------- decoder layer


class LlamaAttention(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, max_position: int) -> None:
        super().__init__()
        hidden_size = self.hidden_size = hf_config.hidden_size
        tp_size, tp_rank = get_tp_world_size(), get_tp_rank()
        total_heads = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hidden_size // total_heads
        # This rank's heads (local counts from here on).
        self.num_heads = divide(total_heads, tp_size, "num_attention_heads")
        if total_kv_heads >= tp_size:
            self.num_kv_heads = divide(total_kv_heads, tp_size, "num_key_value_heads")
            kv_index = tp_rank
        else:  # fewer KV heads than ranks: each is replicated on tp / kv ranks
            replicas = divide(tp_size, total_kv_heads, "with fewer KV heads than ranks, the rank count")
            self.num_kv_heads, kv_index = 1, tp_rank // replicas
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5

        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        # Qwen2 always has q/k/v bias (and no o_proj bias); its config has no switch for it.
        qkv_bias = attention_bias or hf_config.model_type == "qwen2"
        full_q, full_kv = total_heads * self.head_dim, total_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(hidden_size, {
            "q": ShardSpec(self.q_size, tp_rank, full_q),
            "k": ShardSpec(self.kv_size, kv_index, full_kv),
            "v": ShardSpec(self.kv_size, kv_index, full_kv),
        }, bias=qkv_bias)
        self.o_proj = RowParallelLinear(full_q, hidden_size, bias=attention_bias)
        # Qwen3: RMSNorm over each head's vector, before RoPE.
        self.use_qk_norm = hf_config.model_type == "qwen3"
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(hf_config, self.head_dim, max_position)
        self.attn_backend = attn_backend

    def project(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                norm: nn.Module, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(qkv_proj(norm(hidden_states + residual)), the residual stream, rotated). Where the Hopper
        GEMM serves the projection (a step of 2-256 tokens on an H100), its epilogue also norms and
        rotates q and k and stores this step's k and v in the cache (hopper_gemm.linear_rope):
        `rotated` says so, and forward() then skips that work."""
        weight = self.qkv_proj.weight
        if (hopper_gemm.ROPE != "0" and self.attn_backend.stores_kv_with_rope
                and hopper_gemm.supports(hidden_states, weight, self.qkv_proj.bias)):
            q_norm, k_norm = (self.q_norm.weight, self.k_norm.weight) if self.use_qk_norm else (None, None)
            rope = hopper_gemm.QkvRope(
                positions, attn_metadata.slot_mapping, self.rotary_emb.cos_cache, self.rotary_emb.sin_cache, q_norm,
                k_norm, self.q_norm.eps if self.use_qk_norm else 0.0, self.num_heads, self.num_kv_heads, kv_cache,
                attn_metadata.layout(kv_cache))
            if hopper_gemm.supports_rope(hidden_states, weight, self.qkv_proj.bias, rope):
                normed, residual = ops.add_rms_norm(hidden_states, norm.weight, norm.eps, residual)
                return hopper_gemm.linear_rope(normed, weight, rope), residual, True
        qkv, residual = self.qkv_proj.forward_normed(hidden_states, residual, norm)
        return qkv, residual, False

    def forward(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output_rows: OutputRows | None = None,
        rotated: bool = False,
    ) -> torch.Tensor:
        """Attention from the qkv projection's output (project() runs qkv_proj, fused with the norm
        before it; rotated: q and k come normed and rotated, and k and v are in the cache). With
        output_rows, every token's K/V is stored but only those rows attend, and only their outputs
        come back (worker/output_rows.py)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not rotated and self.attn_backend.rotates_in_decode and attn_metadata.max_query_len == 1 and q.is_cuda:
            # A decode step's attention norms, rotates and stores this step's q/k itself (the
            # RoPE kernel's launch saved: ~3 us a layer at batch 1).
            rope = RopeInputs(k, v, positions, self.rotary_emb.cos_cache, self.rotary_emb.sin_cache,
                              *((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.use_qk_norm else ()))
            out = self.attn_backend.decode_rotating(q, kv_cache, attn_metadata, self.scale, rope)
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        kv_stored = rotated
        if not rotated:
            # The RoPE kernel can write k and v to the cache as it goes (a kernel fewer per layer).
            kv_store = None
            if self.attn_backend.stores_kv_with_rope and q.is_cuda:
                kv_store = (v, kv_cache, attn_metadata.slot_mapping, attn_metadata.layout(kv_cache))
            if self.use_qk_norm:
                q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm, kv_store=kv_store)
            else:
                q, k = self.rotary_emb(positions, q, k, kv_store=kv_store)
            kv_stored = kv_store is not None
        if output_rows is not None:
            if not kv_stored:
                self.attn_backend.store(k, v, kv_cache, attn_metadata)
            rows = output_rows.indices
            if not rows.shape[0]:  # a chunk that samples nothing: its K/V was all this layer owed
                return qkv.new_empty((0, self.hidden_size))
            out = self.attn_backend.attend(q[rows], kv_cache, output_rows.metadata, self.scale)
            return self.o_proj(out.reshape(rows.shape[0], self.q_size))
        out = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale, kv_stored=kv_stored)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r}; only silu")
        hidden, intermediate = hf_config.hidden_size, hf_config.intermediate_size
        bias = bool(getattr(hf_config, "mlp_bias", False))
        tp_size, tp_rank = get_tp_world_size(), get_tp_rank()
        self.intermediate_size = divide(intermediate, tp_size, "intermediate_size")  # local
        shard = ShardSpec(self.intermediate_size, tp_rank, intermediate)
        self.gate_up_proj = ColumnParallelLinear(hidden, {"gate": shard, "up": shard}, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.fuses_silu_mul(x):
            return self.down_proj(self.gate_up_proj.silu_mul(x))
        return self.down_proj(self.gate_up_proj(x), gated=True)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this MLP of norm(x + residual), x + residual): the decoder layer's second half, with the
        norm run together with gate|up (ColumnParallelLinear.forward_normed), or gate|up together
        with SiLU-and-mul where one kernel does both (silu_mul)."""
        if self.gate_up_proj.fuses_silu_mul(x):
            normed, residual = ops.add_rms_norm(x, norm.weight, norm.eps, residual)
            return self.down_proj(self.gate_up_proj.silu_mul(normed)), residual
        gate_up, residual = self.gate_up_proj.forward_normed(x, residual, norm)
        return self.down_proj(gate_up, gated=True), residual


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, max_position: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hf_config, attn_backend, max_position)
        self.mlp = LlamaMLP(hf_config)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        output_rows: OutputRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next norm adds
        them. The first layer gets residual None: its input is the residual stream. Each norm
        runs together with the projection after it (one kernel at batch 1 on CUDA).
        output_rows: the attention and the MLP run only for those rows, which alone come back."""
        qkv, residual, rotated = self.self_attn.project(positions, hidden_states, residual, self.input_layernorm,
                                                        kv_cache, attn_metadata)
        hidden_states = self.self_attn(positions, qkv, kv_cache, attn_metadata, output_rows, rotated)
        if output_rows is not None:
            if not hidden_states.shape[0]:
                return hidden_states, hidden_states
            residual = residual[output_rows.indices]
        return self.mlp.forward_normed(hidden_states, residual, self.post_attention_layernorm)


# ---------------------------------------------------------------- the model


class PPMissingLayer(nn.Module):
    """Stands in for a module another pipeline stage holds (no parameters, never called)."""


class LlamaModel(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, max_position: int) -> None:
        super().__init__()
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.start_layer, self.end_layer = pp_layer_range(hf_config.num_hidden_layers)
        self.embed_tokens = (VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
                             if is_first_stage() or (tied and is_last_stage()) else None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, attn_backend, max_position) if self.start_layer <= i < self.end_layer
            else PPMissingLayer() for i in range(hf_config.num_hidden_layers)
        )
        self.stage_layers = list(self.layers)[self.start_layer:self.end_layer]  # a plain list: no copy per step
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps) if is_last_stage() else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """intermediate: the previous stage's (hidden states, residual), on every stage but the first.
        Returns the final normed hidden states on the last stage, else (hidden states, residual).
        output_rows (the last stage only): the last layer runs on those rows past its K/V store,
        and only their hidden states come back, in their order (worker/output_rows.py)."""
        assert output_rows is None or self.norm is not None, "output_rows on a stage before the last"
        if intermediate is None:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = intermediate
        last = len(self.stage_layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.stage_layers, kv_caches, strict=True)):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, attn_metadata,
                                            output_rows if i == last else None)
        if self.norm is None:
            return hidden_states, residual
        if not hidden_states.shape[0]:  # (output_rows: none sample)
            return hidden_states
        return self.norm(hidden_states, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Parameter names mirror HF's (model.layers.N.self_attn..., lm_head) except for the
    fused qkv_proj / gate_up_proj; `packed_modules` tells the loader how to fill those."""

    # checkpoint projection name -> (fused module name, shard id)
    packed_modules: dict[str, tuple[str, str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, max_position: int | None = None) -> None:
        super().__init__()
        self.config = hf_config
        max_position = max_position or hf_config.max_position_embeddings
        self.model = LlamaModel(hf_config, attn_backend, max_position)
        self.packed_logits_weight: torch.Tensor | None = None  # set by pack_for_cpu
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings or not is_last_stage():
            self.lm_head = None  # logits use embed_tokens.weight (this rank's shard of it), if tied
        else:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.vocab_size = hf_config.vocab_size

        first_attn = self.model.stage_layers[0].self_attn
        self.num_layers = len(self.model.stage_layers)  # this stage's: what its KV cache holds
        self.num_kv_heads = first_attn.num_kv_heads  # this rank's: what its KV cache holds
        self.head_dim = first_attn.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids/positions [num_tokens] -> final hidden states [num_tokens, hidden_size], or
        [len(output_rows.indices), hidden_size] for those rows alone (pipeline stages: see
        LlamaModel.forward)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate, output_rows)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] (only the rows that sample) -> full logits [n, vocab_size] on
        every rank (see vocab_parallel_logits for why every rank gets them)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_parallel_logits(hidden_states, weight, self.vocab_size, self.packed_logits_weight)

    def pack_for_cpu(self) -> None:
        """On the CPU (fp32; bf16 where oneDNN has bf16 kernels: cpu_gemm.packs): run every
        projection and the LM head on oneDNN-packed weights (see worker/cpu_gemm.py). The
        embedding keeps its plain table for lookups (tied or not)."""
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.pack_for_cpu()
        if not is_last_stage():
            return  # no LM head on this pipeline stage
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.packed_logits_weight = cpu_gemm.pack(weight)
        if self.lm_head is not None:  # an untied head is read by the logits alone
            self.lm_head.weight = None
