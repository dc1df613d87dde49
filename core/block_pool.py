"""BlockPool: the KV cache's blocks, their reference counts, the queue of free ones, and the
prefix cache (block hash -> block).

Free blocks wait in a doubly linked queue in eviction order: allocation takes from the head.
With prefix caching, a full block keeps its hash when its last user frees it: it stays in the
free queue *and* in the hash map, so a later request with the same prefix can pull it back out
of the middle of the queue (O(1) `remove`) — until allocation reaches it at the head and
evicts its hash.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

# A block's identity in the prefix cache: sha256 over (parent block's hash, the block's token
# ids, extra keys). sha256 rather than Python's hash(): str hashes change per process
# (PYTHONHASHSEED) and 64 bits can collide, and a collision here would hand one request the
# KV of a different prefix, silently wrong output (or one tenant reading another's prompt).
# sha256 of a few dozen ints costs about a microsecond per block, once per full block.
BlockHash = bytes

_encode = msgspec.msgpack.Encoder().encode


def hash_block_tokens(
    parent_block_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None = None
) -> BlockHash:
    """The hash of a full block: it chains the parent's hash, so it names the whole prefix."""
    return hashlib.sha256(_encode((parent_block_hash, list(token_ids), extra_keys))).digest()


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    parent_block_hash: BlockHash | None = None,
    first_block_index: int = 0,
) -> list[BlockHash]:
    """Hashes of the full blocks in `token_ids`, which start at block `first_block_index` of a
    request (whose previous block hashed to `parent_block_hash`). The salt goes into the first
    block only; the chain carries it to every later block."""
    hashes = []
    for i in range(len(token_ids) // block_size):
        salted = first_block_index + i == 0 and cache_salt is not None
        parent_block_hash = hash_block_tokens(
            parent_block_hash, token_ids[i * block_size : (i + 1) * block_size], (cache_salt,) if salted else None
        )
        hashes.append(parent_block_hash)
    return hashes


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's KV cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # Requests using this block; 0 means it sits in the free queue.
        self.ref_cnt = 0
        # Set while the block is full and registered in the prefix cache.
        self.block_hash: BlockHash | None = None
        # Links in FreeKVCacheBlockQueue; None while the block is in use.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = f", hash={self.block_hash.hex()[:8]}" if self.block_hash else ""
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}{cached})"


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

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        """The first `num_blocks` free blocks, taken out at once: one walk down the list and one
        splice, where popleft() per block relinks both neighbours each time (a 16k-token chunk
        takes 1,024 blocks)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"only {self.num_free_blocks} free blocks, {num_blocks} asked for")
        blocks = []
        block = self._head.next_free_block
        for _ in range(num_blocks):
            blocks.append(block)
            next_block = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = next_block
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= num_blocks
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Queue at the tail: evicted last."""
        assert self._tail.prev_free_block is not None
        self._insert_after(self._tail.prev_free_block, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Queue at the head: handed out next."""
        self._insert_after(self._head, block)

    def _insert_after(self, prev_block: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"{block} is already in the free queue")
        next_block = prev_block.next_free_block
        assert next_block is not None
        prev_block.next_free_block = block
        block.prev_free_block = prev_block
        block.next_free_block = next_block
        next_block.prev_free_block = block
        self.num_free_blocks += 1

    def iter_from_head(self, limit: int) -> Iterator[KVCacheBlock]:
        """The first `limit` free blocks, next handed out first (do not change the queue meanwhile)."""
        block = self._head.next_free_block
        while limit > 0 and block is not None and block is not self._tail:
            yield block
            block = block.next_free_block
            limit -= 1

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
    """Hands out and takes back KV cache blocks by reference count; with `enable_caching`, also
    keeps the prefix cache (block hash -> block) of full blocks."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = False) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One block per hash: if two requests compute the same block at once, only the first
        # is registered; the second stays a private (uncached) block.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Told of every cached block about to lose its hash to eviction (its KV still intact): the
        # CPU offload tier spills it. None (no offloading): nothing is called.
        self.on_evict: Callable[[KVCacheBlock], None] | None = None
        # Told of every block newly registered in the prefix cache (when scheduled, before the
        # step computes it): the CPU offload tier copies it out after that step.
        self.on_cached: Callable[[KVCacheBlock], None] | None = None

    # ------------------------------------------------------------------ allocation

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free queue, each with ref_cnt 1, evicting
        the prefix-cache entries of those that still had one.

        Raises ValueError (changing nothing) when fewer are free: callers check
        get_num_free_blocks() first.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {self.free_block_queue.num_free_blocks} free"
            )
        new_blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in new_blocks:
            assert block.ref_cnt == 0, block
            if block.block_hash is not None:  # (checked here: a call per block costs 45% of the loop)
                self._evict(block)
            block.ref_cnt = 1
        return new_blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the order given. Blocks left unused join the
        free queue: cached ones at the tail (the first given is evicted first), uncached ones at
        the head when caching is on, since reusing them loses nothing (without caching,
        everything goes to the tail)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if self.enable_caching and block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    # ------------------------------------------------------------------ prefix cache

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A request takes a reference on cached blocks; free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]) -> None:
        """Register full blocks (in use by a request) under their hashes."""
        assert self.enable_caching
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None:
                assert block.block_hash == block_hash, (block, block_hash.hex())
                continue
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block
                if self.on_cached is not None:
                    self.on_cached(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.on_evict is not None:
                self.on_evict(block)
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only possible while no request holds a block (their
        blocks could otherwise be re-registered half-way); returns whether it happened."""
        num_used = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used:
            logger.warning("cannot reset the prefix cache: %d blocks are still in use", num_used)
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        logger.info("prefix cache reset")
        return True

    # ------------------------------------------------------------------ accounting

    def get_num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (allocation may evict those)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_gpu_blocks
