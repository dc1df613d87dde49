"""The tensor-parallel group: one process per device, joined through torch.distributed.

The executor picks a rendezvous address (a free loopback TCP port) and hands it to every worker
with its rank; rank 0 hosts the store. NCCL on CUDA, gloo on CPU. At world size 1 no group is
made and the collectives below are no-ops, so the single-device path is untouched.

The model's parallel layers read the rank and world size from here when they are built, as
vLLM's `get_tensor_model_parallel_rank()` does: the layers stay plain nn.Modules with no group
handle threaded through their constructors.
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

_rank = 0
_world_size = 1


def init_distributed(rank: int, world_size: int, init_address: str | None, device: torch.device) -> None:
    """Join the group (a no-op at world size 1). Must run before the model is built."""
    global _rank, _world_size
    _rank, _world_size = rank, world_size
    if world_size == 1:
        return
    if init_address is None:
        raise ValueError(f"tensor_parallel_size={world_size} needs a rendezvous address")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}  # NCCL: build the communicator now
    dist.init_process_group(backend, init_method=init_address, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT, **kwargs)
    logger.info("joined the %s group at %s as rank %d of %d", backend, init_address, rank, world_size)


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
    _rank, _world_size = 0, 1


def get_tp_rank() -> int:
    return _rank


def get_tp_world_size() -> int:
    return _world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks, in place; returns x. Capturable in a CUDA graph on NCCL."""
    if _world_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., d] on each rank -> [..., world_size * d], rank 0's part first."""
    if _world_size == 1:
        return x
    x = x.contiguous()
    if dist.get_backend() == "nccl":  # one buffer, no list of tensors to stitch
        gathered = torch.empty((_world_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered, x)
        parts = gathered.unbind(0)
    else:  # gloo has no all_gather_into_tensor
        parts = [torch.empty_like(x) for _ in range(_world_size)]
        dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)
