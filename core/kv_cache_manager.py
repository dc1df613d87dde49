"""KVCacheManager: which blocks each request holds, grown as its computed tokens grow, and the
prefix cache lookups that let a new request start from blocks another request computed."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from minivllm.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_request_blocks
from minivllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


# Requests whose block hashes a new one may take over where their tokens agree (_get_block_hashes).
MAX_HASH_DONORS = 16
# Blocks a prefix-cache lookup hashes before its first check; each later run is twice the last. One:
# a fresh prompt's lookup, the usual miss, hashes one block before the step instead of 16 (a
# 256-prompt batch's first step: ~400 blocks); the rest are hashed when registered, after it.
LOOKUP_HASH_RUN = 1


class KVCacheManager:
    def __init__(self, block_size: int, num_gpu_blocks: int, enable_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        # Logical block i of a request (tokens [i*block_size, (i+1)*block_size)) -> its block.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of each request's leading blocks are registered in the prefix cache already.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache counters (tokens), since start or the last reset_prefix_cache().
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # The latest request to hash its blocks, by (cache salt, its first block's tokens), the
        # most recently used last: a hash donor for the next request that starts the same way.
        self._hash_donors: OrderedDict[tuple, Request] = OrderedDict()
        # With defer_caching, the full blocks a step fills are registered by cache_deferred_blocks()
        # (the EngineCore calls it once the step is on its way to the workers), in the order they
        # were allocated: hashing them is a pass over their tokens (a 16k-token chunk's 1,024
        # blocks: ~1.2 ms on an H100's host) that would otherwise sit between the scheduler and the GPU. Whatever
        # gives blocks back registers what waits first, and so does a lookup whose request begins
        # as a waiting one does (no other lookup can find their blocks), so no lookup, allocation
        # or free sees a difference. (Not with a KV connector, which is told of newly registered
        # blocks for the step that computes them.)
        self.defer_caching = False
        self._blocks_to_cache: list[tuple[Request, list[KVCacheBlock], int]] = []
        self._deferred_first_blocks: set[tuple] = set()  # how those requests begin (_first_block_key)

    # ------------------------------------------------------------------ prefix cache

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks the request's tokens start with, and the number
        of tokens they hold. Nothing is taken yet: allocate_slots() does that.

        The last known token is never served from the cache: the step must compute it to get
        the logits of the next token. (So a fully cached prompt recomputes its last block.)
        """
        # prompt_logprobs need every prompt position's logits, which cached tokens never get: such
        # a request computes its whole prompt (as vLLM does); its blocks are still cached for others.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        assert request.num_computed_tokens == 0, "only requests that hold no blocks look up the cache"
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        if not max_num_blocks:
            return [], 0
        if self._deferred_first_blocks and self._first_block_key(request) in self._deferred_first_blocks:
            self.cache_deferred_blocks()
        computed_blocks: list[KVCacheBlock] = []
        # Blocks are hashed only as far as the lookup goes, in growing runs: the first miss ends the
        # chain, and the blocks after it are hashed when they are registered, chunk by chunk (a
        # fresh 32k-token prompt hashes its first chunk's blocks before its first step, not all).
        num_looked_up, run = 0, LOOKUP_HASH_RUN
        while num_looked_up < max_num_blocks:
            end = min(num_looked_up + run, max_num_blocks)
            for block_hash in self._get_block_hashes(request, end)[num_looked_up:end]:
                block = self.block_pool.get_cached_block(block_hash)
                if block is None:  # the chain breaks here: later blocks hash a prefix nobody computed
                    return computed_blocks, len(computed_blocks) * self.block_size
                computed_blocks.append(block)
            num_looked_up, run = end, 2 * run
        return computed_blocks, len(computed_blocks) * self.block_size

    def _first_block_key(self, request: Request) -> tuple:
        """How a request begins: its cache salt and its first block's tokens (every block hash
        chains back to these)."""
        return request.cache_salt, tuple(request.token_ids_between(0, self.block_size))

    def hash_full_blocks(self, request: Request) -> None:
        """With prefix caching, hash all the request's full blocks now (request.block_hashes): a KV
        connector looks them up past the prefix cache's hits."""
        if self.enable_caching:
            self.cache_deferred_blocks()
            self._get_block_hashes(request)

    def record_prefix_cache_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one request's first lookup (the scheduler calls it once the request is admitted,
        so a lookup retried while the request waits for room is counted once)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        self.cache_deferred_blocks()
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        return True

    def _get_block_hashes(self, request: Request, num_blocks: int | None = None) -> list[BlockHash]:
        """The request's full-block hashes, extended to cover its first `num_blocks` blocks (all
        its full blocks by default; it may hold more already).

        A request hashing its first blocks takes over, for the blocks whose tokens equal theirs, the
        hashes of the latest request that began with the same block and salt (a chat's next turn
        repeats the last turn's prompt and reply): the same tokens and salt make the same chain,
        and comparing tokens is a C loop where sha256 costs ~0.8 us a block (a 16k-token prefix:
        1,024 blocks, 0.8 ms on the 2-core CPU box)."""
        hashes = request.block_hashes
        num_full_blocks = request.num_tokens // self.block_size
        if not hashes and num_full_blocks:  # as far as the donor's tokens agree, however far that is
            hashes.extend(self._donated_hashes(request, num_full_blocks))
        if num_blocks is not None:
            num_full_blocks = min(num_full_blocks, num_blocks)
        if len(hashes) < num_full_blocks:
            first = len(hashes)
            token_ids = request.token_ids_between(first * self.block_size, num_full_blocks * self.block_size)
            hashes.extend(
                hash_request_blocks(
                    token_ids,
                    self.block_size,
                    cache_salt=request.cache_salt,
                    parent_block_hash=hashes[-1] if hashes else None,
                    first_block_index=first,
                )
            )
        return hashes

    def _donated_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """The leading block hashes of the latest request that began as `request` does (same first
        block, same salt), as far as their tokens agree; and `request` becomes that donor."""
        key = self._first_block_key(request)
        donor = self._hash_donors.pop(key, None)
        self._hash_donors[key] = request
        if len(self._hash_donors) > MAX_HASH_DONORS:
            self._hash_donors.popitem(last=False)
        if donor is None or donor is request:
            return []
        block = self.block_size
        # Whole blocks agree up to `low` (the first, by the key); find the last that does.
        low, high = 1, min(num_full_blocks, len(donor.block_hashes), donor.num_tokens // block)
        if high < 1:
            return []

        def agree(num_blocks: int) -> bool:
            end = num_blocks * block
            return request.token_ids_between(0, end) == donor.token_ids_between(0, end)

        if agree(high):
            low = high
        while low < high:  # the first `low` blocks agree, and no more than `high` do
            mid = (low + high + 1) // 2
            if agree(mid):
                low = mid
            else:
                high = mid - 1
        return donor.block_hashes[:low]

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        delay_cache_blocks: bool = False,
    ) -> list[int] | None:
        """Make room for KV of tokens [0, num_computed_tokens + num_new_computed_tokens +
        num_new_tokens), taking `new_computed_blocks` (a prefix-cache hit holding the next
        num_new_computed_tokens tokens) first.

        Returns the ids of the freshly allocated blocks appended to the request's block table
        (maybe none; hit blocks are not among them), or None, changing nothing — no ref count,
        no queue position — when the pool cannot supply them all.

        delay_cache_blocks: the new tokens' KV is loaded asynchronously by a KV connector, so
        their blocks must not be offered to other requests yet (the request's next allocation,
        after the load, registers them).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        assert num_new_computed_tokens == len(new_computed_blocks) * self.block_size
        blocks = self.req_to_blocks.get(request.request_id, [])
        if blocks and not new_computed_blocks:
            # The common case, a decode whose blocks have room for its token: nothing to take
            # (the general path below would come to the same, at several times the cost per
            # request and step).
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(blocks) * self.block_size:
                if self.enable_caching and not delay_cache_blocks:
                    self._cache_full_blocks(request, blocks, num_tokens)
                return []
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_required_blocks = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = max(num_required_blocks - len(blocks) - len(new_computed_blocks), 0)
        # Hit blocks nobody holds sit in the free queue: taking them uses up free blocks too.
        num_evictable_hit_blocks = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_evictable_hit_blocks > self.block_pool.get_num_free_blocks():
            return None
        if not blocks and not new_computed_blocks and num_new_blocks == 0:
            return []  # nothing to hold (and no empty entry left behind)

        # Hits first: allocation below must not evict them.
        self.block_pool.touch(new_computed_blocks)
        blocks = self.req_to_blocks.setdefault(request.request_id, blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        blocks.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            self._cache_full_blocks(request, blocks, num_computed_tokens + num_new_tokens)
        return [block.block_id for block in new_blocks]

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Register the request's blocks that `num_tokens` tokens fill (with defer_caching, at the
        next cache_deferred_blocks() or prefix-cache lookup).

        They are registered when scheduled, before the step computes them: a request admitted
        later in the same step may then share them, which works because the worker writes the
        whole batch's K/V in a layer before attending (see SchedulerOutput). A scheduled request
        is never preempted in its own step, so a registered block is always computed.
        """
        num_full_blocks, num_cached_blocks = self._full_and_registered(request, num_tokens)
        if num_full_blocks <= num_cached_blocks:
            return
        if self.defer_caching:
            self._blocks_to_cache.append((request, blocks, num_tokens))
            # A lookup registers what waits only for a request that begins as one of these does:
            # only such blocks can it find, since a block's hash covers every token before it. (A
            # step's first schedule admits ~30 prompts of different beginnings; registering all that
            # waited at each lookup hashed ~1,000 blocks before the step's GPU work.) A full block
            # is set aside, so the first block's tokens are there and never change.
            self._deferred_first_blocks.add(self._first_block_key(request))
            return
        self._register_full_blocks(request, blocks, num_full_blocks, num_cached_blocks)

    def num_deferred_blocks(self) -> int:
        """About how many blocks cache_deferred_blocks() would register (an entry's count as it was
        set aside: an earlier entry of the same request may register some of them first)."""
        return sum(max(full - registered, 0) for full, registered in
                   (self._full_and_registered(request, num_tokens) for request, _, num_tokens in self._blocks_to_cache))

    def cache_deferred_blocks(self) -> None:
        """Register the blocks defer_caching set aside, in the order they were filled."""
        waiting, self._blocks_to_cache = self._blocks_to_cache, []
        self._deferred_first_blocks.clear()
        for request, blocks, num_tokens in waiting:
            # (counted again here: an earlier entry of the same request may have registered more)
            num_full_blocks, num_cached_blocks = self._full_and_registered(request, num_tokens)
            if num_full_blocks > num_cached_blocks:
                self._register_full_blocks(request, blocks, num_full_blocks, num_cached_blocks)

    def _full_and_registered(self, request: Request, num_tokens: int) -> tuple[int, int]:
        """How many of the request's blocks its first `num_tokens` tokens fill, and how many of its
        blocks are registered in the prefix cache so far."""
        return min(num_tokens, request.num_tokens) // self.block_size, self.num_cached_blocks.get(request.request_id, 0)

    def _register_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_full_blocks: int,
                              num_cached_blocks: int) -> None:
        block_hashes = self._get_block_hashes(request, num_full_blocks)
        self.block_pool.cache_full_blocks(
            blocks[num_cached_blocks:num_full_blocks], block_hashes[num_cached_blocks:num_full_blocks]
        )
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the pool (a no-op if it holds none)."""
        self.free_blocks(self.take_blocks(request))

    def free_tail_blocks(self, request: Request, num_tokens: int) -> int:
        """Give back the request's blocks past those its first `num_tokens` tokens need (they held
        rejected draft tokens only, never a registered block). Returns how many went back."""
        self.cache_deferred_blocks()
        blocks = self.req_to_blocks.get(request.request_id)
        num_kept = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= num_kept:
            return 0
        assert self.num_cached_blocks.get(request.request_id, 0) <= num_kept
        tail = blocks[num_kept:]
        del blocks[num_kept:]
        self.free_blocks(tail)
        return len(tail)

    def take_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request, handing its blocks (still referenced) to the caller, who frees
        them later with free_blocks (a KV connector still reads or writes them)."""
        self.cache_deferred_blocks()
        self.num_cached_blocks.pop(request.request_id, None)
        return self.req_to_blocks.pop(request.request_id, [])

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        # Tail first: a request's last blocks are the least likely to be shared (a prefix is
        # shared from its start), so they are queued to be evicted first.
        self.block_pool.free_blocks(reversed(blocks))

    # ------------------------------------------------------------------ accounting

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()
