"""The CPU offload tier and swap preemption, scheduler side: the OffloadingConnector
(selected by kv_offloading_size alone; preemption_mode="swap" adds swapping).

Host memory holds `num_host_blocks` blocks (kv_offloading_size GiB / the bytes of one block in
every layer). It serves two uses:

* a second-level prefix cache: a GPU block evicted from the prefix cache still holds the KV of
  its hash; it is copied (spilled) into a host block kept in LRU order by hash (copies of blocks
  the GPU still holds are evicted first: HostBlockPool). A request whose
  GPU prefix-cache hit stops at a block the host tier holds loads the run of host blocks that
  follows instead of recomputing it. Blocks are copied out ahead of their eviction, while the
  forwards run: each block registered in the prefix cache, one step after the step that computes
  it (write-through, as vLLM's offloading connector does), and, after each step's scheduling, the
  cached blocks among the next `lookahead_blocks` of the free queue (the next to be evicted) that
  the host does not hold (any more). The step that later reuses such a block waits for its copy
  (long done by then) instead of making one on its critical path. A block evicted before it was
  copied (freed and reused at once) is copied in the step that reuses it, which waits.
* swap: a preempted request's blocks (all of them, the last partly filled one included) are
  copied to host blocks it owns, and copied back when it is admitted again, instead of recomputed.
  Full blocks the tier holds already (copied ahead) are not copied again: the request pins those
  host blocks instead. Swap blocks are never evicted; when the host tier cannot make room the
  request is recomputed.

Loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS while its blocks are copied
in beside the running steps' compute. Host blocks being read by a load are pinned (not evicted)
until the worker reports the load done. The worker runs every copy on one side stream in issue
order, so a host block may be reused right after it is freed here.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from minivllm.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from minivllm.core.kv_connector.base import KVConnectorSchedulerBase
from minivllm.protocol.config import FP8_SCALE_BYTES, EngineConfig
from minivllm.protocol.kv_transfer import BlockCopy, KVConnectorOutput, OffloadingMetadata

if TYPE_CHECKING:
    from minivllm.core.request import Request
    from minivllm.protocol.messages import SchedulerOutput

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def _sort_by_host_block(copy: BlockCopy) -> None:
    """Order a store's pairs by host block: the worker moves each run of consecutive host blocks
    with one DMA, and blocks the LRU gives up together are often neighbours.

    A host block written twice in one store (a full host tier can evict a copy made earlier in the
    same batch and hand its slot out again) keeps only its last write: that is the block the host
    cache now names for the slot. (Sorting the pairs whole would order such writes by GPU block id,
    and the slot would end up holding the evicted copy under the other block's hash.)"""
    last_write = {host: gpu for host, gpu in zip(copy.host_block_ids, copy.gpu_block_ids)}
    copy.host_block_ids = sorted(last_write)
    copy.gpu_block_ids = [last_write[host] for host in copy.host_block_ids]


class HostBlockPool:
    """Host block slots: free ones, cached ones (hash -> slot; evictable unless pinned), and ones
    owned by a swapped-out request (never evicted).

    Cached blocks are kept in two LRU orders. Those the GPU prefix cache dropped are the tier's
    own content. Those copied ahead (write-through) while the GPU still holds them are duplicates:
    a hit on them needs no load, and they cost the tier capacity. Room is made from the duplicates
    first (a dropped one is copied out again ahead of its eviction), so host and GPU together hold
    as many distinct blocks as they have room for: with a working set larger than the host alone,
    a single LRU over both would hold ~one copy less of it and, visited round-robin as
    conversations are, thrash."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_slots: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out slot 0 first
        # least recently used first, each
        self.host_only: OrderedDict[BlockHash, int] = OrderedDict()
        self.on_gpu_too: OrderedDict[BlockHash, int] = OrderedDict()
        self.pins: dict[int, int] = {}  # slot -> loads reading it

    def lookup(self, block_hash: BlockHash) -> int | None:
        slot = self.host_only.get(block_hash)
        return slot if slot is not None else self.on_gpu_too.get(block_hash)

    def num_cached(self) -> int:
        return len(self.host_only) + len(self.on_gpu_too)

    def cached_slots(self) -> list[int]:
        return [*self.host_only.values(), *self.on_gpu_too.values()]

    def insert(self, block_hash: BlockHash, slot: int, on_gpu: bool) -> None:
        """A block just copied out: of a block the GPU keeps (on_gpu) or one it is dropping."""
        assert self.lookup(block_hash) is None
        (self.on_gpu_too if on_gpu else self.host_only)[block_hash] = slot

    def left_gpu(self, block_hash: BlockHash) -> None:
        """The GPU prefix cache dropped this cached block: the host's copy is the one left (and the
        most recently used)."""
        self.host_only[block_hash] = self._pop(block_hash)

    def back_on_gpu(self, block_hash: BlockHash) -> None:
        """This cached block was loaded into a GPU block (which the prefix cache will hold)."""
        self.on_gpu_too[block_hash] = self._pop(block_hash)

    def _pop(self, block_hash: BlockHash) -> int:
        slot = self.host_only.pop(block_hash, None)
        return slot if slot is not None else self.on_gpu_too.pop(block_hash)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` slots (evicting cached blocks: duplicates of GPU blocks first, then the
        least recently used), or None, changing nothing, when not that many are free or evictable."""
        num_to_evict = num_blocks - len(self.free_slots)
        victims: list[tuple[OrderedDict, BlockHash]] = []
        for order in (self.on_gpu_too, self.host_only):
            if len(victims) >= num_to_evict:
                break
            for block_hash, slot in order.items():  # oldest first; pinned ones are few
                if slot not in self.pins:
                    victims.append((order, block_hash))
                    if len(victims) == num_to_evict:
                        break
        if len(victims) < num_to_evict:
            return None
        slots = [self.free_slots.pop() for _ in range(min(num_blocks, len(self.free_slots)))]
        slots += [order.pop(block_hash) for order, block_hash in victims]
        return slots

    def free(self, slots: list[int]) -> None:
        self.free_slots.extend(reversed(slots))

    def pin(self, slots: list[int]) -> None:
        for slot in slots:
            self.pins[slot] = self.pins.get(slot, 0) + 1

    def unpin(self, slots: list[int]) -> None:
        for slot in slots:
            count = self.pins[slot] - 1
            if count:
                self.pins[slot] = count
            else:
                del self.pins[slot]

    def clear_cache(self) -> None:
        """Drop every cached block not being read (reset_prefix_cache)."""
        for order in (self.host_only, self.on_gpu_too):
            for block_hash, slot in list(order.items()):
                if slot not in self.pins:
                    del order[block_hash]
                    self.free_slots.append(slot)


def kv_bytes_per_block(config: EngineConfig) -> int:
    """One block's K and V in every layer, per worker (with tensor parallelism each rank holds its
    share of the KV heads), from the model's config.json: the worker allocates host blocks of its
    real size; this only turns kv_offloading_size into a number of blocks."""
    with open(os.path.join(config.model, "config.json")) as f:
        hf = json.load(f)
    text = hf.get("text_config", hf)
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    kv_heads_per_rank = max(1, kv_heads // config.tensor_parallel_size)
    if config.kv_cache_dtype.startswith("fp8"):
        # e4m3 bytes plus a scale per vector (worker/attention/kv_cache.py's layout)
        return (2 * config.block_size * kv_heads_per_rank * (head_dim + FP8_SCALE_BYTES)
                * int(text["num_hidden_layers"]))
    if config.dtype == "float32":
        element_size = 4
    elif config.dtype in ("bfloat16", "float16"):
        element_size = 2
    else:  # auto: float32 on CPU, bfloat16 on CUDA (as the worker resolves it)
        from minivllm.protocol.config import runs_on_cuda

        element_size = 2 if runs_on_cuda(config.device) else 4
    return 2 * config.block_size * kv_heads_per_rank * head_dim * element_size * int(text["num_hidden_layers"])


class OffloadingConnectorScheduler(KVConnectorSchedulerBase):
    def __init__(self, config: EngineConfig, num_gpu_blocks: int, num_host_blocks: int | None = None) -> None:
        super().__init__(config, num_gpu_blocks)
        if num_host_blocks is None:
            assert config.kv_offloading_size is not None
            bytes_per_block = kv_bytes_per_block(config)
            num_host_blocks = int(config.kv_offloading_size * (1 << 30)) // bytes_per_block
            logger.info("CPU offload tier: %d blocks (%.2f GiB, %d bytes per block); preemption by %s",
                        num_host_blocks, config.kv_offloading_size, bytes_per_block,
                        config.preemption_mode or "recompute")
            if num_host_blocks == 0:
                logger.warning("kv_offloading_size=%g GiB holds no KV block (%d bytes each): the CPU tier is off",
                               config.kv_offloading_size, bytes_per_block)
        self.host = HostBlockPool(num_host_blocks)
        self.swap = config.preemption_mode == "swap"
        # Swapped-out requests: id -> (their host slots, tokens whose KV those hold). A slot is
        # either owned by the swap (in swap_owned; freed when released) or a cached one it pinned.
        self.swapped: dict[str, tuple[list[int], int]] = {}
        self.swap_owned: set[int] = set()
        # What get_num_new_matched_tokens offered, for update_state_after_alloc:
        # id -> (host slots to load, first block index, whether they are the request's swap slots).
        self.offers: dict[str, tuple[list[int], int, bool]] = {}
        # Loads in flight: id -> (host slots read, whether to free them once done rather than unpin).
        self.loading: dict[str, tuple[list[int], bool]] = {}
        self.stores: list[BlockCopy] = []
        self.loads: list[BlockCopy] = []
        # Spilling ahead: the free queue's first blocks looked at after each step, the next
        # batch's number, and the batch each GPU block was copied out in (until evicted).
        self.block_pool: BlockPool | None = None
        self.copy_ahead = True  # False: blocks are copied out only when evicted (tests compare)
        self.lookahead_blocks = cdiv(config.max_num_batched_tokens, self.block_size)
        self.next_ahead_batch = 0
        self.ahead_batch_of_block: dict[int, int] = {}
        # And the batch each host slot was last written by ahead (a load from it waits for that).
        self.ahead_batch_of_slot: dict[int, int] = {}
        self.wait_for_ahead_batch = -1
        # Blocks registered in the prefix cache during this step's / the last step's scheduling
        # (with the hash they got): the last step's are computed by the time this step's
        # metadata reaches the workers (their forwards run in order).
        self.cached_this_step: list[tuple[KVCacheBlock, BlockHash]] = []
        self.cached_last_step: list[tuple[KVCacheBlock, BlockHash]] = []
        self.sent_size = False
        # Counters (blocks), for tests and benchmarks.
        self.num_spilled = self.num_swapped_out = self.num_loaded_hits = self.num_swapped_in = 0
        self.num_spilled_ahead = 0  # of num_spilled
        self.num_swap_shared = 0  # blocks swapped out by pinning a cached host block (not in num_swapped_out)

    # ------------------------------------------------------------------ spills

    def bind_block_pool(self, block_pool: BlockPool) -> None:
        if block_pool.enable_caching and self.host.num_blocks:
            block_pool.on_evict = self._spill
            block_pool.on_cached = self._on_cached
            self.block_pool = block_pool

    def _on_cached(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        self.cached_this_step.append((block, block.block_hash))

    def _spill(self, block: KVCacheBlock) -> None:
        """A cached GPU block is being evicted (and reused in this step): keep its KV on the host."""
        block_hash = block.block_hash
        assert block_hash is not None
        ahead_batch = self.ahead_batch_of_block.pop(block.block_id, None)
        if ahead_batch is not None:  # the forward that overwrites it waits for that copy
            self.wait_for_ahead_batch = max(self.wait_for_ahead_batch, ahead_batch)
        if self.host.lookup(block_hash) is not None:
            self.host.left_gpu(block_hash)  # already there (copied ahead, or spilled and loaded back since)
            return
        slots = self.host.allocate(1)
        if slots is None:
            return  # every host block is pinned or swapped: this one is simply lost
        self.host.insert(block_hash, slots[0], on_gpu=False)
        self._add_store(block.block_id, slots[0])
        self.num_spilled += 1

    def _add_store(self, gpu_block_id: int, host_block_id: int) -> None:
        self.ahead_batch_of_slot.pop(host_block_id, None)  # this store is waited for in its own step
        if not self.stores:
            self.stores.append(BlockCopy([], []))
        self.stores[0].gpu_block_ids.append(gpu_block_id)
        self.stores[0].host_block_ids.append(host_block_id)

    # ------------------------------------------------------------------ swap out

    def request_preempted(self, request: "Request", block_ids: list[int], num_computed_tokens: int) -> None:
        stale = self.swapped.pop(request.request_id, None)  # resumed without loading it back
        if stale is not None:
            self._release_swap_slots(stale[0])
        if not self.swap or num_computed_tokens <= 0:
            return
        num_blocks = cdiv(num_computed_tokens, self.block_size)
        # Full blocks whose KV the host holds under their hash (copied ahead): pinned, not copied.
        shared: dict[int, int] = {}
        for index, block_hash in enumerate(request.block_hashes[:num_computed_tokens // self.block_size]):
            slot = self.host.lookup(block_hash)
            if slot is not None:
                shared[index] = slot
        self.host.pin(list(shared.values()))  # before allocating: that may evict cached slots
        owned = self.host.allocate(num_blocks - len(shared))
        if owned is None:
            self.host.unpin(list(shared.values()))
            logger.debug("no host room to swap out %s (%d blocks): it will be recomputed", request.request_id, num_blocks)
            return
        self.swap_owned.update(owned)
        owned_slots = iter(owned)
        slots = []
        for index, gpu_block_id in enumerate(block_ids[:num_blocks]):
            if index in shared:
                slots.append(shared[index])
            else:
                slots.append(next(owned_slots))
                self._add_store(gpu_block_id, slots[-1])
        self.swapped[request.request_id] = (slots, num_computed_tokens)
        self.num_swapped_out += len(owned)
        self.num_swap_shared += len(shared)

    def _release_swap_slots(self, slots: list[int]) -> None:
        """Give back a swap's host slots: free the ones it owned, unpin the cached ones it shared."""
        owned = [slot for slot in slots if slot in self.swap_owned]
        self.swap_owned.difference_update(owned)
        self.host.free(owned)
        self.host.unpin([slot for slot in slots if slot not in owned])

    # ------------------------------------------------------------------ loads

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        request_id = request.request_id
        first_block = num_computed_tokens // self.block_size
        self._withdraw_offer(request_id)
        swapped = self.swapped.get(request_id)
        if swapped is not None:
            slots, num_swapped_tokens = swapped
            target = min(num_swapped_tokens, request.num_tokens - 1)
            if target <= num_computed_tokens:  # the GPU prefix cache still holds it all
                del self.swapped[request_id]
                self._release_swap_slots(slots)
                return 0, False
            self.offers[request_id] = (slots[first_block:cdiv(target, self.block_size)], first_block, True)
            return target - num_computed_tokens, True
        if not self.host.num_cached():
            return 0, False
        # The run of host-cached full blocks right after the GPU hit (never the block holding the
        # last known token: its logits are needed). block_hashes cover every full block by now.
        max_blocks = (request.num_tokens - 1) // self.block_size
        slots = []
        for block_hash in request.block_hashes[first_block:max_blocks]:
            slot = self.host.lookup(block_hash)
            if slot is None:
                break
            slots.append(slot)
        if not slots:
            return 0, False
        # Pinned from now: the allocation that follows may spill GPU blocks, which must not evict these.
        self.host.pin(slots)
        self.offers[request_id] = (slots, first_block, False)
        return len(slots) * self.block_size, True

    def _withdraw_offer(self, request_id: str) -> None:
        offer = self.offers.pop(request_id, None)
        if offer is not None and not offer[2]:
            self.host.unpin(offer[0])

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        offered, first_block, is_swap = self.offers.pop(request.request_id)
        num_blocks = cdiv(request.num_computed_tokens + num_external_tokens, self.block_size) - first_block
        slots = offered[:num_blocks]
        gpu_block_ids = block_ids[first_block:first_block + num_blocks]
        assert len(gpu_block_ids) == len(slots) == num_blocks, (len(gpu_block_ids), len(slots), num_blocks)
        if is_swap:
            # The swapped KV moves back: the request's remaining host slots go now (blocks the GPU
            # prefix cache still held were not needed), the loaded ones once the load is done.
            all_slots, _ = self.swapped.pop(request.request_id)
            loaded = set(slots)
            self._release_swap_slots([slot for slot in all_slots if slot not in loaded])
            self.num_swapped_in += num_blocks
        else:
            self.host.unpin(offered[num_blocks:])  # offered but not taken (the scheduler clamped)
            for block_hash in request.block_hashes[first_block:first_block + num_blocks]:
                self.host.back_on_gpu(block_hash)
            self.num_loaded_hits += num_blocks
        self.loading[request.request_id] = (slots, is_swap)
        # A slot copied ahead whose GPU block was never evicted (so nothing waited for the copy
        # yet): the loads run behind this step's forward, so the forward waits for that batch.
        for slot in slots:
            batch = self.ahead_batch_of_slot.get(slot)
            if batch is not None:
                self.wait_for_ahead_batch = max(self.wait_for_ahead_batch, batch)
        self.loads.append(BlockCopy(gpu_block_ids, slots, request.request_id))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for request_id in [*output.finished_recving, *output.failed_recving]:
            loading = self.loading.pop(request_id, None)
            if loading is not None:
                slots, is_swap = loading
                if is_swap:
                    self._release_swap_slots(slots)
                else:
                    self.host.unpin(slots)

    # ------------------------------------------------------------------ per step, and the end

    def _spill_ahead(self) -> BlockCopy | None:
        """Copy out, ahead of their eviction, the blocks the last step computed and the cached
        blocks the free queue hands out next, where the host tier does not hold them yet (see the
        module docstring). A batch never makes room by evicting its own copies (pinned until it is
        built): on a full tier that would only trade the blocks evicted soonest for later ones, a
        wasted copy each."""
        if self.block_pool is None or not self.copy_ahead:
            return None
        computed, self.cached_last_step, self.cached_this_step = self.cached_last_step, self.cached_this_step, []
        # (A block whose hash changed since was evicted meanwhile: spilled then, or lost.)
        candidates = [block for block, block_hash in computed if block.block_hash == block_hash]
        candidates += self.block_pool.free_block_queue.iter_from_head(self.lookahead_blocks)
        copy = BlockCopy([], [])
        for block in candidates:
            block_hash = block.block_hash
            if block_hash is None or self.host.lookup(block_hash) is not None:
                continue  # uncached, or the host holds it (copied ahead, or spilled and loaded back)
            slots = self.host.allocate(1)
            if slots is None:
                break  # every host block is pinned (this batch's copies among them) or swapped
            self.host.insert(block_hash, slots[0], on_gpu=True)
            self.host.pin(slots)
            copy.gpu_block_ids.append(block.block_id)
            copy.host_block_ids.append(slots[0])
            self.ahead_batch_of_block[block.block_id] = self.next_ahead_batch
            self.ahead_batch_of_slot[slots[0]] = self.next_ahead_batch
        self.host.unpin(copy.host_block_ids)
        if not copy.gpu_block_ids:
            return None
        _sort_by_host_block(copy)
        self.num_spilled += len(copy.gpu_block_ids)
        self.num_spilled_ahead += len(copy.gpu_block_ids)
        return copy

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> OffloadingMetadata | None:
        ahead = self._spill_ahead()
        if not self.stores and not self.loads and ahead is None and self.wait_for_ahead_batch < 0 and self.sent_size:
            return None
        self.sent_size = True  # the first step's metadata makes the workers allocate the host blocks
        for copy in self.stores:
            _sort_by_host_block(copy)
        meta = OffloadingMetadata(self.host.num_blocks, self.stores, self.loads,
                                  ahead_stores=[] if ahead is None else [ahead],
                                  ahead_batch=-1 if ahead is None else self.next_ahead_batch,
                                  wait_for_ahead_batch=self.wait_for_ahead_batch)
        if ahead is not None:
            self.next_ahead_batch += 1
        self.stores, self.loads = [], []
        self.wait_for_ahead_batch = -1
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # A swapped-out request that will never resume (aborted) gives its host blocks back; one
        # whose load is in flight gives them back when the load is reported.
        self._withdraw_offer(request.request_id)
        swapped = self.swapped.pop(request.request_id, None)
        if swapped is not None:
            self._release_swap_slots(swapped[0])
        return False, None

    def reset_prefix_cache(self) -> None:
        self.host.clear_cache()
        # The GPU blocks lose their hashes, so no eviction will say when one copied ahead is
        # reused: the next forward waits for every copy made ahead so far (loads queue behind it).
        self.wait_for_ahead_batch = max(self.wait_for_ahead_batch, self.next_ahead_batch - 1)
        self.ahead_batch_of_block.clear()
        self.ahead_batch_of_slot.clear()
        self.cached_this_step.clear()
        self.cached_last_step.clear()

    def has_pending_work(self) -> bool:
        return bool(self.stores or self.loads)
