"""BlockPool, its free queue, and KVCacheManager (pure Python, no torch)."""

from __future__ import annotations

import pytest

from minivllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.protocol.sampling_params import SamplingParams


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def make_request(request_id: str = "r", num_prompt_tokens: int = 1) -> Request:
    return Request(request_id, list(range(num_prompt_tokens)), SamplingParams(), arrival_time=0.0)


# ---------------------------------------------------------------- free queue


def test_free_queue_popleft_append_remove_keep_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert len(queue) == 5
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 2, 3, 4]

    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])  # from the middle
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None

    queue.append(blocks[2])
    queue.append(blocks[0])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4, 2, 0]
    assert queue.num_free_blocks == 5

    queue.remove(blocks[0])  # the tail
    queue.remove(blocks[1])  # the head
    assert [b.block_id for b in queue.get_all_free_blocks()] == [3, 4, 2]
    assert [queue.popleft().block_id for _ in range(3)] == [3, 4, 2]
    assert len(queue) == 0 and queue.get_all_free_blocks() == []


def test_free_queue_popleft_n_takes_the_head_in_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[1])
    assert queue.popleft_n(0) == [] and len(queue) == 5
    assert [b.block_id for b in queue.popleft_n(3)] == [0, 2, 3]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in blocks[:4])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [4, 5] and len(queue) == 2
    queue.appendleft(blocks[0])  # the list still links both ways at the splice
    queue.append(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 4, 5, 2]
    with pytest.raises(ValueError):
        queue.popleft_n(5)  # more than are free: nothing taken
    assert len(queue) == 4
    assert [b.block_id for b in queue.popleft_n(4)] == [0, 4, 5, 2]
    assert len(queue) == 0 and queue.get_all_free_blocks() == []
    queue.append(blocks[3])  # and an emptied queue takes blocks again
    assert [b.block_id for b in queue.get_all_free_blocks()] == [3]


def test_free_queue_appendleft_puts_a_block_next_in_line() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.appendleft(blocks[2])
    queue.append(blocks[3])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [2, 0, 1, 3]
    assert queue.popleft() is blocks[2] and len(queue) == 3
    with pytest.raises(ValueError):
        queue.appendleft(blocks[0])  # already queued


def test_free_queue_misuse_raises() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        queue.append(blocks[0])  # already queued
    queue.popleft()
    queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()  # empty
    with pytest.raises(ValueError):
        queue.remove(blocks[0])  # not queued


# ---------------------------------------------------------------- block pool


def test_allocation_takes_from_the_head_and_freed_blocks_go_to_the_tail() -> None:
    pool = BlockPool(6)
    first = pool.get_new_blocks(2)
    assert [b.block_id for b in first] == [0, 1]
    assert all(b.ref_cnt == 1 for b in first)
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == pytest.approx(2 / 6)

    pool.free_blocks(reversed(first))
    assert free_ids(pool) == [2, 3, 4, 5, 1, 0]
    assert all(b.ref_cnt == 0 for b in first)
    # The next allocation takes the least recently freed blocks first.
    assert [b.block_id for b in pool.get_new_blocks(5)] == [2, 3, 4, 5, 1]


def test_shared_block_is_freed_only_when_its_last_reference_goes() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # a second user (what prefix caching will do)
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.get_num_free_blocks() == 2
    with pytest.raises(ValueError):
        pool.free_blocks([block])  # double free


def test_failed_allocation_changes_nothing() -> None:
    pool = BlockPool(4)
    held = pool.get_new_blocks(3)
    before = [(b.block_id, b.ref_cnt) for b in pool.blocks]
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert [(b.block_id, b.ref_cnt) for b in pool.blocks] == before
    assert free_ids(pool) == [3]
    pool.free_blocks(held)
    assert pool.get_num_free_blocks() == 4
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.get_usage() == 0.0


def test_pool_rejects_zero_blocks() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


# ---------------------------------------------------------------- KV cache manager


def test_allocate_slots_grows_block_table_as_needed() -> None:
    manager = KVCacheManager(block_size=4, num_gpu_blocks=8)
    request = make_request(num_prompt_tokens=10)
    assert manager.allocate_slots(request, 6) == [0, 1]  # tokens [0, 6) -> 2 blocks
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 2) == []  # [0, 8) still fits in 2 blocks
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 2) == [2]
    request.num_computed_tokens = 10
    assert manager.allocate_slots(request, 1) == []
    assert manager.get_block_ids("r") == [0, 1, 2]
    assert manager.get_num_free_blocks() == 5


def test_allocate_slots_is_all_or_nothing() -> None:
    manager = KVCacheManager(block_size=2, num_gpu_blocks=3)
    big, small = make_request("big", 8), make_request("small", 2)
    assert manager.allocate_slots(small, 2) == [0]
    assert manager.allocate_slots(big, 8) is None  # needs 4 blocks, only 2 free
    assert manager.get_block_ids("big") == []
    assert "big" not in manager.req_to_blocks
    assert manager.get_num_free_blocks() == 2
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks if b.block_id != 0)


def test_free_returns_blocks_tail_first() -> None:
    manager = KVCacheManager(block_size=1, num_gpu_blocks=4)
    request = make_request(num_prompt_tokens=3)
    assert manager.allocate_slots(request, 3) == [0, 1, 2]
    manager.free(request)
    assert free_ids(manager.block_pool) == [3, 2, 1, 0]
    assert manager.get_block_ids("r") == []
    manager.free(request)  # a request holding nothing: harmless
    assert manager.get_num_free_blocks() == 4
    assert manager.usage == 0.0
