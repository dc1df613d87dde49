"""The CPU offload tier and swap preemption, worker side (see core/kv_connector/offloading.py).

Host blocks live in one tensor per layer shaped like the GPU cache, [2, num_host_blocks,
block_size, num_kv_heads, head_dim], pinned on CUDA (so copies are asynchronous DMA), plain
memory on CPU. Runs of consecutive block ids on both sides are copied with one call per layer.

On CUDA the copies run on two side streams:
  stores: wait for the compute already queued (the blocks' last writes), copy out; the step's
          forward then waits for the stores (not for loads), since it may overwrite those blocks;
  loads:  wait for the compute already queued (earlier users of the destination blocks) and for
          the stores issued so far (a load may read a host block stored in the same step), then
          copy in while the forward computes; each load records an event, polled in get_finished.
A host block is reused by the scheduler only after the loads reading it were reported, i.e. done
on rank 0; with tensor parallelism the other ranks' stores also wait for their own loads in
flight. A request is scheduled only after rank 0 saw its load complete; every rank also makes its
compute stream wait for the loads of the requests it schedules (a no-op on rank 0).
On CPU the copies are plain and synchronous: a load is reported in the step it was issued.
"""

from __future__ import annotations

import logging

import torch

from minivllm.protocol.config import EngineConfig
from minivllm.protocol.kv_transfer import BlockCopy, KVConnectorOutput, OffloadingMetadata
from minivllm.protocol.messages import SchedulerOutput
from minivllm.worker.kv_connector.base import KVConnectorWorkerBase

logger = logging.getLogger(__name__)


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both block id lists go up by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class OffloadingConnectorWorker(KVConnectorWorkerBase):
    metadata_type = OffloadingMetadata

    def __init__(self, config: EngineConfig, rank: int, device: torch.device) -> None:
        super().__init__(config, rank, device)
        self.host_caches: list[torch.Tensor] = []
        self.cuda = device.type == "cuda"
        self.store_stream = torch.cuda.Stream(device) if self.cuda else None
        self.load_stream = torch.cuda.Stream(device) if self.cuda else None
        self.stores_done: torch.cuda.Event | None = None
        # Loads issued and not reported yet: request id -> completion event (None on CPU: done).
        self.loads_in_flight: dict[str, torch.cuda.Event | None] = {}

    def _allocate_host_blocks(self, num_host_blocks: int) -> None:
        layer = self.kv_caches[0]
        shape = (2, num_host_blocks, *layer.shape[2:])
        self.host_caches = [torch.empty(shape, dtype=cache.dtype, pin_memory=self.cuda) for cache in self.kv_caches]
        size = sum(t.numel() * t.element_size() for t in self.host_caches)
        logger.info("CPU offload tier: %d host blocks, %.2f GiB%s", num_host_blocks, size / (1 << 30),
                    " pinned" if self.cuda else "")

    def _copy(self, copy: BlockCopy, to_host: bool) -> None:
        for gpu_start, host_start, length in block_runs(copy.gpu_block_ids, copy.host_block_ids):
            for gpu_layer, host_layer in zip(self.kv_caches, self.host_caches):
                for kv in (0, 1):  # K and V apart: each run is then contiguous on both sides
                    gpu = gpu_layer[kv, gpu_start:gpu_start + length]
                    host = host_layer[kv, host_start:host_start + length]
                    if to_host:
                        host.copy_(gpu, non_blocking=self.cuda)
                    else:
                        gpu.copy_(host, non_blocking=self.cuda)

    def handle_preemptions(self) -> None:
        meta: OffloadingMetadata | None = self.connector_metadata
        if meta is None:
            return
        if not self.host_caches and meta.num_host_blocks:
            self._allocate_host_blocks(meta.num_host_blocks)
        if not meta.stores:
            return
        if not self.cuda:
            for copy in meta.stores:
                self._copy(copy, to_host=True)
            return
        compute = torch.cuda.current_stream(self.device)
        self.store_stream.wait_stream(compute)
        if self.config.tensor_parallel_size > 1:
            for event in self.loads_in_flight.values():
                self.store_stream.wait_event(event)
        with torch.cuda.stream(self.store_stream):
            for copy in meta.stores:
                self._copy(copy, to_host=True)
        self.stores_done = torch.cuda.Event()
        self.stores_done.record(self.store_stream)
        compute.wait_event(self.stores_done)  # the forward may overwrite what the stores read

    def start_load_kv(self, scheduler_output: SchedulerOutput) -> None:
        meta: OffloadingMetadata | None = self.connector_metadata
        if self.cuda and self.loads_in_flight:
            # Requests scheduled now whose load this rank may not have seen land (ranks > 0).
            compute = torch.cuda.current_stream(self.device)
            for new in scheduler_output.scheduled_new_reqs:
                event = self.loads_in_flight.get(new.req_id)
                if event is not None:
                    compute.wait_event(event)
        if meta is None or not meta.loads:
            return
        if not self.cuda:
            for copy in meta.loads:
                self._copy(copy, to_host=False)
                self.loads_in_flight[copy.req_id] = None
            return
        self.load_stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.stores_done is not None:
            self.load_stream.wait_event(self.stores_done)
        with torch.cuda.stream(self.load_stream):
            for copy in meta.loads:
                self._copy(copy, to_host=False)
                event = torch.cuda.Event()
                event.record(self.load_stream)
                self.loads_in_flight[copy.req_id] = event

    def get_finished(self, finished_req_ids: list[str]) -> KVConnectorOutput | None:
        if not self.loads_in_flight:
            return None
        done = [req_id for req_id, event in self.loads_in_flight.items() if event is None or event.query()]
        if not done:
            return None
        for req_id in done:
            del self.loads_in_flight[req_id]
        return KVConnectorOutput(finished_recving=done)

    def shutdown(self) -> None:
        if self.cuda:
            self.store_stream.synchronize()
            self.load_stream.synchronize()
