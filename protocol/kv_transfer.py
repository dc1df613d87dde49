"""KV transfer messages and the KV connector registry (vLLM V1's KV connector design).

A KV connector moves KV cache blocks in or out of this engine: to host memory (the CPU offload
tier, swap preemption) or to/from another engine (prefill/decode disaggregation). It has two
halves that talk only through the two messages below:

  scheduler side (core/kv_connector/, no torch)            worker side (worker/kv_connector/)
    decides what moves, per step  --KVConnectorMetadata-->   moves it (copies, sends, receives)
    (in SchedulerOutput.kv_connector_metadata)
                                  <--KVConnectorOutput----   reports which requests' transfers
    (in ModelRunnerOutput.kv_connector_output)                  finished

A connector's per-step instructions are its own msgspec Struct, carried msgpack-encoded in
KVConnectorMetadata.payload (so a new connector needs no change here beyond one registry line).
"""

from __future__ import annotations

import importlib
from typing import Any

import msgspec


class KVConnectorMetadata(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's instructions from the scheduler-side connector to the worker-side connector.

    A SchedulerOutput that carries one is always delivered to the workers, even with no tokens
    scheduled (then it only moves KV and collects finished transfers)."""

    # The connector's own metadata Struct, msgpack-encoded (b"": nothing this step).
    payload: bytes = b""
    # Requests whose transfer the scheduler gave up on (timeout): their blocks are freed in this
    # very step, so the worker side must drop these transfers before the forward and never read or
    # write those blocks again.
    expired_req_ids: list[str] = []


class KVConnectorOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the worker-side connector reports after a step: requests whose asynchronous
    transfers completed since its last report (each id is reported once)."""

    # Delayed-free requests (request_finished returned True) whose blocks were fully read out:
    # the scheduler frees their blocks now.
    finished_sending: list[str] = []
    # Requests waiting for KV (WAITING_FOR_REMOTE_KVS) whose blocks are now filled: they are
    # scheduled from the next step on.
    finished_recving: list[str] = []
    # Requests waiting for KV whose load failed: they finish with an error (ERROR_KV_TRANSFER).
    failed_recving: list[str] = []


# KVTransferConfig.kv_connector name -> (scheduler-side class, worker-side class), as
# "module:Class" paths imported on first use (the scheduler side in the EngineCore process, the
# worker side in each worker; neither imports the other).
KV_CONNECTORS: dict[str, tuple[str, str]] = {
    "OffloadingConnector": (
        "minivllm.core.kv_connector.offloading:OffloadingConnectorScheduler",
        "minivllm.worker.kv_connector.offloading:OffloadingConnectorWorker",
    ),
    # Prefill/decode disaggregation over ZMQ/TCP raw frames (core/ and worker/kv_connector/pd_*).
    "ZmqTcpConnector": (
        "minivllm.core.kv_connector.pd_connector:PDConnectorScheduler",
        "minivllm.worker.kv_connector.pd_connector:PDConnectorWorker",
    ),
    # The same, the blocks moving device to device: NCCL between GPUs (gloo between CPU instances).
    "P2pNcclConnector": (
        "minivllm.core.kv_connector.pd_connector:PDConnectorScheduler",
        "minivllm.worker.kv_connector.pd_connector:P2pNcclConnectorWorker",
    ),
}
# What kv_offloading_size alone selects (as in vLLM, the CPU offload tier is a connector inside).
OFFLOADING_CONNECTOR = "OffloadingConnector"


def register_kv_connector(name: str, scheduler_class_path: str, worker_class_path: str) -> None:
    """Make a connector selectable as KVTransferConfig(kv_connector=name)."""
    KV_CONNECTORS[name] = (scheduler_class_path, worker_class_path)


def kv_connector_name(config: Any) -> str | None:
    """The connector an EngineConfig selects: kv_transfer_config's, else the offloading connector
    when kv_offloading_size is set, else None (no connector: the step loop does no KV transfer work)."""
    if config.kv_transfer_config is not None:
        return config.kv_transfer_config.kv_connector
    if config.kv_offloading_size is not None:
        return OFFLOADING_CONNECTOR
    return None


def load_kv_connector_class(name: str, side: str) -> type:
    """The scheduler-side ("scheduler") or worker-side ("worker") class registered under `name`."""
    if name not in KV_CONNECTORS:
        raise ValueError(f"unknown kv_connector {name!r}; registered: {', '.join(sorted(KV_CONNECTORS))}")
    path = KV_CONNECTORS[name][0 if side == "scheduler" else 1]
    module_name, _, class_name = path.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


# ---------------------------------------------------------------- the OffloadingConnector's metadata


class BlockCopy(msgspec.Struct, array_like=True):
    """Copy GPU blocks to host blocks (a store) or host blocks to GPU blocks (a load), pairwise."""

    gpu_block_ids: list[int]
    host_block_ids: list[int]
    # For a load: the request that waits for it (reported in finished_recving once it landed).
    req_id: str = ""


class OffloadingMetadata(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step of the CPU offload tier.

    stores: GPU blocks the scheduler just freed for reuse in this step (spilled prefix-cache
        blocks, swapped-out requests): the forward waits for them.
    ahead_stores: cached blocks near the head of the free queue (the next to be evicted), copied
        out while the forward runs, so that their eviction later costs no wait; they form batch
        `ahead_batch`.
    wait_for_ahead_batch: this step reuses blocks stored ahead in that batch (or an earlier one):
        the forward waits for it (-1: none).
    loads: fill blocks of requests in WAITING_FOR_REMOTE_KVS; they run alongside the forward."""

    num_host_blocks: int
    stores: list[BlockCopy] = []
    loads: list[BlockCopy] = []
    ahead_stores: list[BlockCopy] = []
    ahead_batch: int = -1
    wait_for_ahead_batch: int = -1
