"""KVCacheManager: which blocks each request holds, grown as its computed tokens grow."""

from __future__ import annotations

from core.block_pool import BlockPool, KVCacheBlock
from core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(self, block_size: int, num_gpu_blocks: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.block_pool = BlockPool(num_gpu_blocks)
        # Logical block i of a request (tokens [i*block_size, (i+1)*block_size)) -> its block.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for KV of tokens [0, num_computed_tokens + num_new_tokens).

        Returns the ids of the blocks appended to the request's block table (maybe none),
        or None, changing nothing, when the pool cannot supply them all.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_required_blocks = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = num_required_blocks - len(blocks)
        if num_new_blocks <= 0:
            return []
        if num_new_blocks > self.block_pool.get_num_free_blocks():
            return None
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        self.req_to_blocks.setdefault(request.request_id, blocks).extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the pool (a no-op if it holds none)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        # Tail first: a request's last blocks are the least likely to be shared later, so they
        # should be evicted first once prefix caching keeps freed blocks around.
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()
