"""The CPU offload tier and swap preemption, worker side (see core/kv_connector/offloading.py).

Host blocks live in one tensor, [num_host_blocks, num_layers, 2 (K, V), block_size, ...]: a
host block holds its K and V of every layer in one contiguous piece, pinned on CUDA (so copies are
asynchronous DMA), plain memory on CPU. A copy goes through a staging buffer of STAGING_BLOCKS
blocks laid out the same way, beside the GPU cache: a store gathers the blocks of every layer into
it (one gather per layer) and then moves each run of consecutive host ids with one DMA; a load
does the reverse. So the number of copy calls grows with the runs, not with runs x layers x 2
(copying block by block, layer by layer, cost ~20 us of host time per 32 KiB piece: the tier was
slower than recomputing on an H100).

On CUDA the copies run on two side streams:
  stores: wait for the compute already queued (the blocks' last writes), copy out; the step's
          forward then waits for the stores (not for loads), since it may overwrite those blocks;
          ahead stores (blocks not reused yet) follow them on the same stream, and only a later
          step that reuses one of their blocks waits for them (wait_for_ahead_batch);
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
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from minivllm.protocol.config import EngineConfig
from minivllm.protocol.kv_transfer import BlockCopy, KVConnectorOutput, OffloadingMetadata
from minivllm.protocol.messages import SchedulerOutput
from minivllm.worker.attention.kv_cache import stacked_layers
from minivllm.worker.kv_connector.base import KVConnectorWorkerBase

logger = logging.getLogger(__name__)

STAGING_BLOCKS = 16  # blocks per staging pass (one buffer per direction: ~30 MiB for Qwen3-0.6B's KV)


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both block id lists go up by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def _touch_in_threads(tensor: torch.Tensor, num_threads: int = 8) -> None:
    """Zero a large host tensor from several threads: registering (pinning) pages the kernel has
    already faulted in is quicker, and the faults themselves spread over cores (16 GiB on the H100
    host: 10 s to register untouched, 3 s touching in 8 threads + 2 s registering)."""
    flat = tensor.view(-1)
    chunk = -(flat.numel() // -num_threads)
    with ThreadPoolExecutor(num_threads) as pool:  # fill_ drops the GIL
        list(pool.map(lambda start: flat[start:start + chunk].zero_(), range(0, flat.numel(), chunk)))


class OffloadingConnectorWorker(KVConnectorWorkerBase):
    metadata_type = OffloadingMetadata

    def __init__(self, config: EngineConfig, rank: int, device: torch.device) -> None:
        super().__init__(config, rank, device)
        self.host_blocks: torch.Tensor | None = None
        self.registered = False  # host_blocks pinned by cudaHostRegister
        self.blocks_first: torch.Tensor | None = None  # the caches, block-major (_blocks_first_view)
        self.staging: dict[bool, torch.Tensor] = {}
        self.cuda = device.type == "cuda"
        self.store_stream = torch.cuda.Stream(device) if self.cuda else None
        self.load_stream = torch.cuda.Stream(device) if self.cuda else None
        # The last stores the forward waited for (loads wait for them too: they may read host
        # blocks stored just now). Not ahead stores: a load reads a host block only once its GPU
        # block was evicted, and that step's forward, which the loads queue behind, waited for it.
        self.stores_done: torch.cuda.Event | None = None
        # Batches of ahead stores (see core/kv_connector/offloading.py) not seen done yet.
        self.ahead_events: dict[int, torch.cuda.Event] = {}
        # Loads issued and not reported yet: request id -> completion event (None on CPU: done).
        self.loads_in_flight: dict[str, torch.cuda.Event | None] = {}

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.blocks_first = self._blocks_first_view()
        # Allocate (and pin) the host tier now, at start-up: pinning GiBs of host memory takes
        # seconds, which on the first step would stall the first requests served.
        bytes_per_block = self.blocks_first[0].numel() * self.blocks_first.element_size()
        num_host_blocks = int(self.config.kv_offloading_size * (1 << 30)) // bytes_per_block
        if num_host_blocks:
            self._allocate_host_blocks(num_host_blocks)

    def _allocate_host_blocks(self, num_host_blocks: int) -> None:
        self._free_host_blocks()
        block_shape = self.blocks_first.shape[1:]  # a block of every layer: [num_layers, 2, block_size, ...]
        dtype = self.blocks_first.dtype
        start = time.perf_counter()
        self.host_blocks = torch.empty((num_host_blocks, *block_shape), dtype=dtype)
        size = self.host_blocks.numel() * self.host_blocks.element_size()
        if self.cuda:
            _touch_in_threads(self.host_blocks)
            # Pinned by registering the tensor's own pages: pin_memory=True would round the
            # allocation up to a power of two (PyTorch's caching host allocator), up to 2x the size asked.
            err = torch.cuda.cudart().cudaHostRegister(self.host_blocks.data_ptr(), size, 0)
            if int(err) != 0:
                raise RuntimeError(f"could not pin {size / (1 << 30):.2f} GiB of host memory for the CPU offload "
                                   f"tier (cudaHostRegister error {int(err)}): lower kv_offloading_size")
            self.registered = True
        # One staging buffer per side stream (stores and loads may run at once).
        self.staging = {to_host: torch.empty((STAGING_BLOCKS, *block_shape), dtype=dtype, device=self.device)
                        for to_host in (True, False)}
        logger.info("CPU offload tier: %d host blocks, %.2f GiB%s, in %.1f s", num_host_blocks, size / (1 << 30),
                    " pinned" if self.cuda else "", time.perf_counter() - start)

    def _free_host_blocks(self) -> None:
        if self.registered and self.host_blocks is not None:
            torch.cuda.cudart().cudaHostUnregister(self.host_blocks.data_ptr())
        self.registered = False
        self.host_blocks = None

    def _blocks_first_view(self) -> torch.Tensor:
        """The layers' caches as one view [num_blocks, num_layers, 2, ...] (block-major, like a host
        block), so that a copy moves every layer's K and V of its blocks in one indexing op. They
        must be views of one tensor at a constant layer stride (KVCacheLayout.allocate_layers)."""
        stacked = stacked_layers(self.kv_caches, "the CPU offload tier")
        return stacked.transpose(0, 2).transpose(1, 2)  # [L, 2, blocks, ...] -> [blocks, L, 2, ...]

    def _copy(self, copy: BlockCopy, to_host: bool) -> None:
        """Move the blocks of `copy` (GPU -> host when to_host), STAGING_BLOCKS at a time, on the
        current stream: each pass waits on the stream for the one before it to free the staging buffer."""
        staging = self.staging[to_host]
        all_ids = torch.tensor(copy.gpu_block_ids, device=self.device)  # one small host-to-device copy
        for at in range(0, len(copy.gpu_block_ids), STAGING_BLOCKS):
            index = all_ids[at:at + STAGING_BLOCKS]
            host_runs = block_runs(list(range(len(index))), copy.host_block_ids[at:at + STAGING_BLOCKS])
            stage = staging[:len(index)]
            if to_host:
                torch.index_select(self.blocks_first, 0, index, out=stage)  # every layer's K and V at once
                for first, host_start, length in host_runs:
                    self.host_blocks[host_start:host_start + length].copy_(stage[first:first + length],
                                                                           non_blocking=self.cuda)
            else:
                for first, host_start, length in host_runs:
                    stage[first:first + length].copy_(self.host_blocks[host_start:host_start + length],
                                                      non_blocking=self.cuda)
                self.blocks_first.index_copy_(0, index, stage)

    def handle_preemptions(self) -> None:
        meta: OffloadingMetadata | None = self.connector_metadata
        if meta is None:
            return
        host_blocks_here = 0 if self.host_blocks is None else self.host_blocks.shape[0]
        if meta.num_host_blocks != host_blocks_here:  # the scheduler sized the tier from config.json
            logger.warning("CPU offload tier: the scheduler counts %d host blocks, this worker %d: reallocating",
                           meta.num_host_blocks, host_blocks_here)
            if meta.num_host_blocks:
                self._allocate_host_blocks(meta.num_host_blocks)
            else:
                self._free_host_blocks()
        if not self.cuda:  # plain copies, in order, before the forward
            for copy in (*meta.stores, *meta.ahead_stores):
                self._copy(copy, to_host=True)
            return
        compute = torch.cuda.current_stream(self.device)
        waited = self.ahead_events.pop(meta.wait_for_ahead_batch, None) if meta.wait_for_ahead_batch >= 0 else None
        if waited is not None:  # the forward reuses blocks copied out in that batch (the stream is in order)
            compute.wait_event(waited)
        for batch in [batch for batch, event in self.ahead_events.items() if event.query()]:
            del self.ahead_events[batch]  # done: a later wait for it is a no-op
        if not meta.stores and not meta.ahead_stores:
            return
        self.store_stream.wait_stream(compute)
        if self.config.tensor_parallel_size > 1:
            for event in self.loads_in_flight.values():
                self.store_stream.wait_event(event)
        if meta.stores:
            self.stores_done = self._store(meta.stores)
            compute.wait_event(self.stores_done)  # the forward may overwrite what the stores read
        if meta.ahead_stores:  # after the ones the forward waits for, and not waited for here
            self.ahead_events[meta.ahead_batch] = self._store(meta.ahead_stores)

    def _store(self, copies: list[BlockCopy]) -> torch.cuda.Event:
        """Queue copies out on the store stream; the event marks their end."""
        with torch.cuda.stream(self.store_stream):
            for copy in copies:
                self._copy(copy, to_host=True)
        event = torch.cuda.Event()
        event.record(self.store_stream)
        return event

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
            self._free_host_blocks()
