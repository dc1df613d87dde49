"""BlockPool: the KV cache's blocks, their reference counts, and the queue of free ones.

Free blocks wait in a doubly linked queue in eviction order: allocation takes from the head
(least recently freed), freeing appends at the tail. Prefix caching will keep freed blocks that
still hold a hashed prefix in this same queue, so a later request can pull one back out of the
middle (O(1) `remove`) until allocation reaches it and evicts its hash.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's KV cache."""

    __slots__ = ("block_id", "ref_cnt", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # Requests using this block; 0 means it sits in the free queue.
        self.ref_cnt = 0
        # Links in FreeKVCacheBlockQueue; None while the block is in use.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    A Python deque cannot remove from the middle in O(1); prefix caching needs that.
    Two sentinel nodes keep every operation free of edge cases.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail; for tests and debugging (O(n))."""
        blocks = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """Hands out and takes back KV cache blocks by reference count."""

    def __init__(self, num_gpu_blocks: int) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free queue, each with ref_cnt 1.

        Raises ValueError (changing nothing) when fewer are free: callers check
        get_num_free_blocks() first.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {self.free_block_queue.num_free_blocks} free"
            )
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            # Prefix caching hooks in here: evict the block's hash before reusing it.
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those left unused join the tail of the queue,
        in the order given (the first given is evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_gpu_blocks
