"""The workers' torch.distributed groups: tensor parallelism within a pipeline stage, and the
point-to-point links between consecutive stages.

World = pipeline_parallel_size x tensor_parallel_size ranks; rank = pp_rank * tp + tp_rank, so a
stage's TP group is tp consecutive ranks, and TP rank t of stage s sends its hidden states to TP
rank t of stage s + 1 (rank + tp). The executor picks a rendezvous address (a free TCP port on
rank 0's host) and hands it to every worker with its rank; rank 0 hosts the store. NCCL on CUDA,
gloo on CPU. At world size 1 no group is made and the collectives below are no-ops, so the
single-device path is untouched; with one stage the TP group is the whole world (no subgroup).

The model's parallel layers read the TP rank and size from here when they are built, as vLLM's
`get_tensor_model_parallel_rank()` does: the layers stay plain nn.Modules with no group handle
threaded through their constructors. Likewise the model reads which layers are its stage's
(pp_layer_range) and whether it embeds (first stage) or samples (last stage).
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A collective that waits this long has lost a peer the executor failed to notice; the executor
# normally kills the group within seconds of a death, so this only bounds a true hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)

_rank = 0  # TP rank within the stage
_world_size = 1  # TP size
_pp_rank = 0
_pp_size = 1
_global_rank = 0
_tp_group: dist.ProcessGroup | None = None  # None: the default (world) group, or no group at all


def init_distributed(rank: int, world_size: int, init_address: str | None, device: torch.device,
                     pipeline_parallel_size: int = 1) -> None:
    """Join the group (a no-op when there is one rank in all). Must run before the model is built.
    rank: the global rank; world_size: the TP size (ranks per stage)."""
    global _rank, _world_size, _pp_rank, _pp_size, _global_rank, _tp_group
    total = world_size * pipeline_parallel_size
    _global_rank, _world_size, _pp_size = rank, world_size, pipeline_parallel_size
    _rank, _pp_rank = rank % world_size, rank // world_size
    _tp_group = None
    if total == 1:
        return
    if init_address is None:
        raise ValueError(f"{total} ranks (tensor x pipeline parallel) need a rendezvous address")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}  # NCCL: build the communicator now
    dist.init_process_group(backend, init_method=init_address, rank=rank, world_size=total,
                            timeout=COLLECTIVE_TIMEOUT, **kwargs)
    if pipeline_parallel_size > 1 and world_size > 1:
        # Every rank creates every stage's group, in the same order (new_group is collective).
        for stage in range(pipeline_parallel_size):
            group = dist.new_group(list(range(stage * world_size, (stage + 1) * world_size)),
                                   timeout=COLLECTIVE_TIMEOUT)
            if stage == _pp_rank:
                _tp_group = group
    logger.info("joined the %s group at %s as rank %d of %d (stage %d of %d, TP rank %d of %d)", backend,
                init_address, rank, total, _pp_rank, pipeline_parallel_size, _rank, world_size)


def destroy_distributed(graphs_captured: bool = False) -> None:
    """Leave the group (clean shutdown only: with a dead peer, exiting is enough).

    Not after NCCL collectives were captured in CUDA graphs: ncclCommDestroy can then hang
    (pytorch/pytorch#115388); the process exits right after and the driver frees the communicator.
    """
    global _rank, _world_size
    if dist.is_initialized():
        if graphs_captured and dist.get_backend() == "nccl":
            logger.info("leaving the NCCL group by exiting (its collectives live in CUDA graphs)")
        else:
            dist.destroy_process_group()
    global _pp_rank, _pp_size, _global_rank, _tp_group
    _rank, _world_size, _pp_rank, _pp_size, _global_rank, _tp_group = 0, 1, 0, 1, 0, None


def get_tp_rank() -> int:
    return _rank


def get_tp_world_size() -> int:
    return _world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks, in place; returns x. Capturable in a CUDA graph on NCCL."""
    if _world_size > 1:
        dist.all_reduce(x, group=_tp_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., d] on each rank -> [..., world_size * d], rank 0's part first."""
    if _world_size == 1:
        return x
    x = x.contiguous()
    if dist.get_backend(_tp_group) == "nccl":  # one buffer, no list of tensors to stitch
        gathered = torch.empty((_world_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered, x, group=_tp_group)
        parts = gathered.unbind(0)
    else:  # gloo has no all_gather_into_tensor
        parts = [torch.empty_like(x) for _ in range(_world_size)]
        dist.all_gather(parts, x, group=_tp_group)
    return torch.cat(parts, dim=-1)


# ---------------------------------------------------------------- pipeline stages


def get_pp_rank() -> int:
    return _pp_rank


def get_pp_world_size() -> int:
    return _pp_size


def is_first_stage() -> bool:
    return _pp_rank == 0


def is_last_stage() -> bool:
    return _pp_rank == _pp_size - 1


def pp_layer_range(num_layers: int, pp_rank: int | None = None, pp_size: int | None = None) -> tuple[int, int]:
    """Layers [start, end) of a stage (this worker's by default): num_layers // pp_size each, and
    the remainder one extra each to the stages before the last, from the second-to-last backwards
    (vLLM's split): the last stage also computes the LM head and samples."""
    pp_rank = _pp_rank if pp_rank is None else pp_rank
    pp_size = _pp_size if pp_size is None else pp_size
    base, extra = divmod(num_layers, pp_size)
    sizes = [base] * pp_size
    for i in range(extra):
        sizes[(pp_size - 2 - i) % pp_size] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]



def get_global_rank() -> int:
    return _global_rank


def get_stage_rank(pp_rank: int) -> int:
    """The global rank of this worker's TP peer in stage pp_rank."""
    return pp_rank * _world_size + _rank
