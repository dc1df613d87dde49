"""Megatron-style tensor-parallel layers. Each rank holds one shard of every big weight:

  ColumnParallelLinear    output rows split: each rank computes its slice of y, no communication
                          (q|k|v and gate|up, several checkpoint projections stacked in one matmul)
  RowParallelLinear       input columns split: each rank computes a partial y from its slice of x,
                          then one all-reduce sums them (o_proj, down_proj)
  VocabParallelEmbedding  vocab rows split: a rank looks up the ids it owns, zeros the rest, and
                          an all-reduce sums the ranks' rows (exact: all but one addend are zero)
  vocab_parallel_logits   the LM head (its own weight, or the tied embedding's shard, which has the
                          same layout): each rank scores its vocab slice, an all-gather joins them

So an attention or MLP block is column -> local work -> row, one all-reduce per block. At world
size 1 every layer is the plain one (the collectives are no-ops).

Each layer's `load_weight` takes the *full* checkpoint tensor, or a safetensors slice of it (the
`get_slice` handle), and reads only this rank's rows or columns, so a rank never materializes
the whole tensor. A vocab not divisible by the world size is padded: the last rank's padding rows
stay zero and their logits are cut off after the gather.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.worker import cpu_gemm, hopper_gemm, ops, prompt_gemm, small_batch_gemm
from minivllm.worker.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_world_size

# A torch tensor or a safetensors PySafeSlice: both index like a tensor; the slice reads only what
# is indexed from the file.
Loadable = Any


def loaded_shape(loaded: Loadable) -> tuple[int, ...]:
    return tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)


@torch.no_grad()
def _copy_checked(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    if target.shape != source.shape:
        raise ValueError(f"{what}: expected {tuple(target.shape)}, got {tuple(source.shape)}")
    target.copy_(source)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def projection(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               packed_weight: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T + b for a projection layer, on the path that suits it: oneDNN's packed weight on
    the CPU (worker/cpu_gemm.py), the one-row kernel for a single row on CUDA
    (worker/small_batch_gemm.py), the Hopper kernel for a decode step's few hundred rows
    (worker/hopper_gemm.py), else F.linear."""
    if packed_weight is not None:
        return cpu_gemm.linear(x, packed_weight, bias)
    if small_batch_gemm.supports(x, weight):
        return small_batch_gemm.linear(x, weight, bias)
    if hopper_gemm.supports(x, weight, bias):
        return hopper_gemm.linear(x, weight)
    return F.linear(x, weight, bias)


class ShardSpec(NamedTuple):
    """One checkpoint projection inside a column-parallel layer: this rank takes rows
    [index * local_size, (index + 1) * local_size) of a checkpoint tensor of full_size rows.
    Replicated KV heads are several ranks with the same index."""

    local_size: int
    index: int
    full_size: int


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b, W's output rows split across ranks; y stays split (no communication)."""

    def __init__(self, in_features: int, shards: dict[str, ShardSpec], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.shards = shards
        self.shard_slices: dict[str, slice] = {}
        start = 0
        for shard_id, spec in shards.items():
            self.shard_slices[shard_id] = slice(start, start + spec.local_size)
            start += spec.local_size
        self.out_features = start  # local
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self.packed_weight: torch.Tensor | None = None  # set by pack_for_cpu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return projection(x, self.weight, self.bias, self.packed_weight)

    def fuses_silu_mul(self, x: torch.Tensor) -> bool:
        """Whether silu_mul(x) takes silu(gate) * up of this fused gate|up layer from one kernel:
        the Hopper GEMM's epilogue for a decode step's rows (worker/hopper_gemm.py), the Triton
        kernel of worker/prompt_gemm.py for a prompt step's, where they serve this product."""
        return self.packed_weight is None and (
            self._hopper_gated(x) or prompt_gemm.supports_silu_mul(x, self.weight, self.bias))

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a fused gate|up layer, from one kernel: only where fuses_silu_mul(x)
        holds (elsewhere the caller projects, then runs SiLU-and-mul)."""
        if self._hopper_gated(x):
            return hopper_gemm.linear(x, self.weight, silu_mul=True)
        return prompt_gemm.silu_mul_linear(x, self.weight)

    def _hopper_gated(self, x: torch.Tensor) -> bool:
        """Whether the Hopper GEMM's gated epilogue takes this product (a decode step's rows)."""
        return hopper_gemm.SILU_MUL and hopper_gemm.supports(x, self.weight, self.bias)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """This projection of norm(x + residual) (of norm(x) without a residual), and x + residual:
        a pre-norm block's norm and first projection. One kernel for a single row on CUDA
        (small_batch_gemm.norm_linear); `norm` is an RMSNorm (its weight, its eps)."""
        if small_batch_gemm.supports(x, self.weight):  # (never with a packed weight: self.weight is None)
            return small_batch_gemm.norm_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias)
        normed, residual = ops.add_rms_norm(x, norm.weight, norm.eps, residual)  # (x itself without a residual)
        return self(normed), residual

    def pack_for_cpu(self) -> None:
        """Run on oneDNN's packed copy of the weight from now on (see worker/cpu_gemm.py); the
        plain weight is dropped, so call this once the weights are loaded."""
        self.packed_weight, self.weight = cpu_gemm.pack(self.weight), None

    def load_weight(self, param_name: str, loaded: Loadable, shard_id: str) -> None:
        spec = self.shards[shard_id]
        shape = loaded_shape(loaded)
        if shape[0] != spec.full_size:
            raise ValueError(f"shard {shard_id!r} of {param_name}: expected {spec.full_size} rows, got {shape}")
        start = spec.index * spec.local_size
        target = getattr(self, param_name)[self.shard_slices[shard_id]]
        _copy_checked(target, loaded[start : start + spec.local_size], f"shard {shard_id!r} of {param_name}")


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks: x arrives split (from a column
    layer), each rank's partial product is summed by one all-reduce. Rank 0 alone adds the bias,
    inside its matmul, so the sum counts it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.world_size, self.rank = get_tp_world_size(), get_tp_rank()
        self.in_features = divide(in_features, self.world_size, "a row-parallel layer's input size")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed_weight: torch.Tensor | None = None  # set by pack_for_cpu

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """gated: x is gate | up (a fused column layer's output) and this layer's input is
        silu(gate) * up, computed inside the projection for a single row on CUDA."""
        bias = self.bias if self.rank == 0 else None
        if gated:
            if small_batch_gemm.supports(x, self.weight):
                return all_reduce(small_batch_gemm.silu_mul_linear(x, self.weight, bias))
            x = ops.silu_and_mul(x)
        return all_reduce(projection(x, self.weight, bias, self.packed_weight))

    pack_for_cpu = ColumnParallelLinear.pack_for_cpu

    def load_weight(self, param_name: str, loaded: Loadable) -> None:
        if param_name == "bias":  # replicated
            _copy_checked(self.bias, loaded[:], "bias")
            return
        shape = loaded_shape(loaded)
        if shape != (self.weight.shape[0], self.in_features * self.world_size):
            raise ValueError(f"weight: expected {(self.weight.shape[0], self.in_features * self.world_size)}, "
                             f"got {shape}")
        start = self.rank * self.in_features
        _copy_checked(self.weight, loaded[:, start : start + self.in_features], "weight")


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks in contiguous blocks of ceil(vocab / world) rows."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.world_size, self.rank = get_tp_world_size(), get_tp_rank()
        self.rows_per_rank = -(-vocab_size // self.world_size)
        self.vocab_start = self.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)  # real rows end here
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size))  # padding rows stay 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        embeddings = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(embeddings)

    def load_weight(self, param_name: str, loaded: Loadable) -> None:
        shape = loaded_shape(loaded)
        if shape != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"{param_name}: expected {(self.vocab_size, self.weight.shape[1])}, got {shape}")
        num_real = self.vocab_end - self.vocab_start
        _copy_checked(self.weight[:num_real], loaded[self.vocab_start : self.vocab_end], param_name)


class ParallelLMHead(VocabParallelEmbedding):
    """The untied output projection: the same row split as the embedding (so a tied model can use
    the embedding's shard in its place). Logits come from `vocab_parallel_logits`."""


def vocab_parallel_logits(hidden_states: torch.Tensor, weight_shard: torch.Tensor, vocab_size: int,
                          packed_weight_shard: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [n, hidden] -> full logits [n, vocab_size] on every rank (through the oneDNN-packed
    copy of the weight shard when there is one).

    Every rank gets the full logits (an all-gather rather than a gather to rank 0 plus a broadcast
    of the sampled ids): each rank then samples the same tokens from the same bits with the same
    seeds, keeps its own copy of them for the next step, and no extra collective is needed.
    """
    if packed_weight_shard is not None:
        local_logits = cpu_gemm.linear(hidden_states, packed_weight_shard, None)
    else:
        local_logits = F.linear(hidden_states, weight_shard)
    logits = all_gather_last_dim(local_logits)
    return logits if logits.shape[-1] == vocab_size else logits[..., :vocab_size].contiguous()
