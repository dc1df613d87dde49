"""Prefix caching (pure Python, no torch): block hashes, hits and ref counts, eviction order, salts,
all-or-nothing allocation, and the scheduler using hits (same step, after preemption)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minivllm.core.block_pool import BlockPool, hash_block_tokens, hash_request_blocks
from minivllm.core.kv_cache_manager import LOOKUP_HASH_RUN, KVCacheManager
from minivllm.core.request import Request
from minivllm.protocol.sampling_params import SamplingParams
from tests.unit.scheduler_harness import default_token, make_request, make_scheduler, run_to_completion, step

BLOCK_SIZE = 4


def make_req(request_id: str, token_ids: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, token_ids, SamplingParams(), arrival_time=0.0, cache_salt=cache_salt)


def compute(manager: KVCacheManager, request: Request, num_tokens: int | None = None) -> list[int]:
    """Admit a request the way the scheduler does (taking its cache hit) and mark `num_tokens`
    (default: all) as computed; returns its block ids."""
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    num_new = (request.num_tokens if num_tokens is None else num_tokens) - num_hit_tokens
    assert manager.allocate_slots(request, num_new, num_hit_tokens, hit_blocks) is not None
    request.num_computed_tokens = num_hit_tokens + num_new
    return manager.get_block_ids(request.request_id)


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def ref_counts(pool: BlockPool) -> list[int]:
    return [block.ref_cnt for block in pool.blocks]


# ---------------------------------------------------------------- hashes


def test_block_hash_chains_the_parent_and_extra_keys() -> None:
    tokens = list(range(100, 112))
    h0 = hash_block_tokens(None, tokens[0:4])
    h1 = hash_block_tokens(h0, tokens[4:8])
    h2 = hash_block_tokens(h1, tokens[8:12])
    assert hash_request_blocks(tokens, 4) == [h0, h1, h2]
    assert hash_request_blocks(tokens + [7, 7], 4) == [h0, h1, h2]  # a partial block has no hash
    # Resuming the chain part-way gives the same hashes.
    assert hash_request_blocks(tokens[8:], 4, parent_block_hash=h1, first_block_index=2) == [h2]
    # The same tokens after a different prefix are a different block.
    assert hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), tokens[4:8]) != h1
    assert hash_block_tokens(None, tokens[4:8]) != h1
    # A salt changes the first block, and through the chain every later one.
    salted = hash_request_blocks(tokens, 4, cache_salt="tenant-a")
    assert all(s != h for s, h in zip(salted, [h0, h1, h2]))
    assert hash_request_blocks(tokens, 4, cache_salt="tenant-a") == salted
    assert hash_request_blocks(tokens, 4, cache_salt="tenant-b")[0] != salted[0]
    assert len(h0) == 32  # sha256


def test_block_hashes_do_not_depend_on_the_process() -> None:
    code = "from core.block_pool import hash_request_blocks as h; print(h([5, 6, 7, 8], 4, 'salt')[0].hex())"
    env = dict(os.environ, PYTHONHASHSEED="123")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert other.stdout.strip() == hash_request_blocks([5, 6, 7, 8], 4, "salt")[0].hex()


def test_request_block_hashes_extend_as_outputs_fill_blocks() -> None:
    manager = KVCacheManager(BLOCK_SIZE, 16, enable_caching=True)
    request = make_req("a", list(range(100, 106)))
    compute(manager, request)
    assert request.block_hashes == hash_request_blocks(list(range(100, 106)), 4)  # 1 full block
    request.output_token_ids += [1, 2]  # 8 tokens: block 1 is full now
    manager.allocate_slots(request, 2)
    assert request.block_hashes == hash_request_blocks(list(range(100, 106)) + [1, 2], 4)
    manager.free(request)


def test_a_lookup_registers_waiting_blocks_only_for_a_request_that_begins_as_they_do() -> None:
    """defer_caching (the engine's): blocks a step fills wait to be registered. A lookup by a
    request that begins otherwise (or with another salt) leaves them waiting, hashing nothing of
    theirs (their hashes cannot be among its); one that begins the same way registers them first
    and hits them in the same step."""
    manager = KVCacheManager(BLOCK_SIZE, 64, enable_caching=True)
    manager.defer_caching = True
    shared = list(range(100, 120))  # 5 full blocks
    a = make_req("a", shared + [1, 2])
    compute(manager, a)
    assert manager.num_deferred_blocks() == 5 and a.block_hashes[:1] == hash_request_blocks(shared[:4], BLOCK_SIZE)
    for other in (make_req("b", list(range(200, 230))), make_req("c", shared + [3], cache_salt="s")):
        assert manager.get_computed_blocks(other) == ([], 0)
        assert manager.num_deferred_blocks() == 5 and len(a.block_hashes) == 1  # a's still wait, unhashed
        assert len(other.block_hashes) == LOOKUP_HASH_RUN
    d = make_req("d", shared + [4, 5])
    blocks, num_hit_tokens = manager.get_computed_blocks(d)
    assert manager.num_deferred_blocks() == 0 and num_hit_tokens == 20
    assert [block.block_id for block in blocks] == manager.get_block_ids("a")[:5]


def test_a_long_prompt_hashes_only_as_far_as_the_lookup_and_its_scheduled_chunks_go() -> None:
    # 600 full blocks of 4: a miss at the first block hashes one run; each chunk then hashes its
    # own blocks when they are registered, and together they equal hashing the whole prompt.
    prompt = list(range(1000, 3401))
    manager = KVCacheManager(BLOCK_SIZE, 700, enable_caching=True)
    request = make_req("a", prompt)
    assert manager.get_computed_blocks(request) == ([], 0)
    assert len(request.block_hashes) == LOOKUP_HASH_RUN
    for chunk in range(1, 4):
        manager.allocate_slots(request, 800)
        request.num_computed_tokens += 800
        assert len(request.block_hashes) == 200 * chunk
    assert request.block_hashes == hash_request_blocks(prompt, BLOCK_SIZE)
    # A later request with the first 150 blocks in common hits them all, looking up in growing
    # runs (1, 2, 4, ..., 128 blocks) and hashing no further than the run that missed.
    later = make_req("b", prompt[:600] + [7] * 1000)
    manager._hash_donors.clear()  # (none taken over from "a": the lookup hashes them)
    blocks, num_hit_tokens = manager.get_computed_blocks(later)
    assert num_hit_tokens == 600 and [b.block_id for b in blocks] == manager.get_block_ids("a")[:150]
    assert LOOKUP_HASH_RUN == 1 and len(later.block_hashes) == 1 + 2 + 4 + 8 + 16 + 32 + 64 + 128
    # A KV connector looks past the hits: hash_full_blocks covers the whole prompt.
    manager.hash_full_blocks(later)
    assert later.block_hashes == hash_request_blocks(later.all_token_ids, BLOCK_SIZE)
    manager.free(request)


def test_a_request_takes_the_hashes_of_the_last_that_began_the_same_way_where_tokens_agree(monkeypatch) -> None:
    """A chat's next turn repeats the last turn's tokens: it takes that request's block hashes as far
    as their tokens agree (no sha256 for them), and hashes the rest. Its hashes always equal
    hashing every block, whatever donor it met: a longer or shorter one, one parting mid-block or
    at a block's edge, one with outputs, one with another salt (no donor), another first block."""
    import minivllm.core.block_pool as block_pool

    manager = KVCacheManager(BLOCK_SIZE, 256, enable_caching=True)
    base = list(range(100, 140))  # 10 blocks
    calls = []

    def blocks_hashed(tokens, salt=None, outputs=()) -> int:
        """How many blocks the request hashed itself (its hashes checked against hashing all)."""
        request = make_req(f"r{len(calls)}", tokens, cache_salt=salt)
        request.output_token_ids += list(outputs)
        calls.clear()
        with monkeypatch.context() as patch:
            patch.setattr(block_pool, "hash_block_tokens", lambda *a: calls.append(a) or hash_block_tokens(*a))
            got = list(manager._get_block_hashes(request))
        assert got == hash_request_blocks(tokens + list(outputs), BLOCK_SIZE, cache_salt=salt)
        return len(calls)

    assert blocks_hashed(base[:22], outputs=[7, 8]) == 6  # 6 full blocks, the last with its outputs
    assert blocks_hashed(base[:22] + [7, 8] + base[24:]) == 10 - 6  # agrees with all 6 donated blocks
    # (Each request is the next one's donor.)
    assert blocks_hashed(base[:12] + [1] + base[13:]) == 10 - 3  # parts at block 3's first token
    assert blocks_hashed(base[:9] + [1] + base[10:]) == 10 - 2  # parts inside block 2
    assert blocks_hashed(base[:6]) == 0  # shorter than its donor: 1 full block
    assert blocks_hashed(base, salt="other") == 10  # another salt: no donor
    assert blocks_hashed([1] + base[1:]) == 10  # another first block: no donor
    for i in range(20):  # at most MAX_HASH_DONORS donors are kept
        blocks_hashed([i] + base[1:8])
    assert len(manager._hash_donors) == 16


def test_donated_hashes_equal_hashing_on_random_turns() -> None:
    """Random requests that share prefixes with earlier ones (a few first blocks, cut anywhere, salted
    or not): every request's hashes equal hashing its tokens."""
    import random

    rng = random.Random(0)
    manager = KVCacheManager(BLOCK_SIZE, 256, enable_caching=True)
    earlier = [[rng.randrange(5) for _ in range(rng.randrange(1, 60))] for _ in range(4)]
    for i in range(300):
        tokens = rng.choice(earlier)[: rng.randrange(0, 60)] + [rng.randrange(5) for _ in range(rng.randrange(1, 30))]
        salt = rng.choice([None, None, "s"])
        request = make_req(f"r{i}", tokens, cache_salt=salt)
        assert manager._get_block_hashes(request) == hash_request_blocks(tokens, BLOCK_SIZE, cache_salt=salt)
        earlier[rng.randrange(4)] = tokens


# ---------------------------------------------------------------- hits and ref counts


def test_shared_prefix_hit_takes_the_blocks_with_ref_count_2() -> None:
    manager = KVCacheManager(BLOCK_SIZE, 16, enable_caching=True)
    pool = manager.block_pool
    prefix = list(range(100, 108))  # two full blocks
    a = make_req("a", prefix + [1, 2, 3])
    a_blocks = compute(manager, a)
    assert a_blocks == [0, 1, 2]

    b = make_req("b", prefix + [9, 9, 9, 9, 9])
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hit_blocks] == [0, 1] and num_hit_tokens == 8
    b_blocks = compute(manager, b)
    assert b_blocks[:2] == [0, 1] and set(b_blocks[2:]).isdisjoint(a_blocks)
    assert [pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 2, 1]

    manager.free(a)  # shared blocks stay held by b
    assert [pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [1, 1, 0]
    assert 0 not in free_ids(pool) and 1 not in free_ids(pool)
    manager.free(b)
    assert ref_counts(pool) == [0] * 16 and pool.get_num_free_blocks() == 16
    # Freed, yet still cached: a third request hits them, pulling them out of the free queue.
    c = make_req("c", prefix + [5])
    assert compute(manager, c)[:2] == [0, 1]
    assert pool.blocks[0].ref_cnt == 1 and 0 not in free_ids(pool)
    manager.free(c)


def test_the_last_token_is_always_computed() -> None:
    manager = KVCacheManager(BLOCK_SIZE, 16, enable_caching=True)
    prompt = list(range(100, 108))  # exactly two blocks
    a = make_req("a", prompt)
    compute(manager, a)
    # A fully cached prompt still computes its last block: its last token's logits are needed.
    assert manager.get_computed_blocks(make_req("b", prompt))[1] == 4
    assert manager.get_computed_blocks(make_req("c", prompt + [1]))[1] == 8
    assert manager.get_computed_blocks(make_req("d", prompt[:3]))[1] == 0
    manager.free(a)


def test_hit_stops_at_the_first_missing_block() -> None:
    manager = KVCacheManager(BLOCK_SIZE, 16, enable_caching=True)
    a = make_req("a", list(range(100, 112)))
    compute(manager, a)
    changed_middle = list(range(100, 104)) + [0, 0, 0, 0] + list(range(108, 112)) + [1]
    assert manager.get_computed_blocks(make_req("b", changed_middle))[1] == 4
    manager.free(a)


def test_cache_salt_gives_a_miss() -> None:
    manager = KVCacheManager(BLOCK_SIZE, 16, enable_caching=True)
    prompt = list(range(100, 109))
    a = make_req("a", prompt, cache_salt="alice")
    compute(manager, a)
    assert manager.get_computed_blocks(make_req("b", prompt, cache_salt="bob"))[1] == 0
    assert manager.get_computed_blocks(make_req("c", prompt))[1] == 0
    assert manager.get_computed_blocks(make_req("d", prompt, cache_salt="alice"))[1] == 8
    manager.free(a)


def test_prefix_caching_off_never_hits_or_hashes() -> None:
    manager = KVCacheManager(BLOCK_SIZE, 8, enable_caching=False)
    a = make_req("a", list(range(100, 109)))
    compute(manager, a)
    assert manager.get_computed_blocks(make_req("b", list(range(100, 109)))) == ([], 0)
    assert manager.block_pool.cached_block_hash_to_block == {} and a.block_hashes == []
    manager.free(a)
    assert free_ids(manager.block_pool) == [3, 4, 5, 6, 7, 2, 1, 0]  # plain LRU: freed to the tail


# ---------------------------------------------------------------- eviction


def test_a_requests_tail_blocks_are_evicted_first() -> None:
    manager = KVCacheManager(BLOCK_SIZE, 4, enable_caching=True)
    pool = manager.block_pool
    prompt = list(range(100, 115))  # 3 full blocks + 3 tokens
    a = make_req("a", prompt)
    assert compute(manager, a) == [0, 1, 2, 3]
    manager.free(a)
    # The partial block holds nothing reusable: it is handed out first. Then the full blocks,
    # last block first, so the shared-from-the-start prefix survives longest.
    assert free_ids(pool) == [3, 2, 1, 0]
    assert [blk.block_id for blk in pool.get_new_blocks(2)] == [3, 2]
    assert len(pool.cached_block_hash_to_block) == 2  # block 2's hash was evicted
    assert manager.get_computed_blocks(make_req("b", prompt))[1] == 8  # blocks 0 and 1 still hit
    pool.free_blocks(pool.blocks[2:4])


def test_least_recently_freed_request_is_evicted_first() -> None:
    manager = KVCacheManager(BLOCK_SIZE, 4, enable_caching=True)
    pool = manager.block_pool
    a, b = make_req("a", list(range(100, 108))), make_req("b", list(range(200, 208)))
    compute(manager, a)
    compute(manager, b)
    manager.free(a)
    manager.free(b)
    assert free_ids(pool) == [1, 0, 3, 2]
    pool.get_new_blocks(2)  # a's blocks go
    assert manager.get_computed_blocks(make_req("a2", list(range(100, 109))))[1] == 0
    assert manager.get_computed_blocks(make_req("b2", list(range(200, 209))))[1] == 8
    pool.free_blocks(pool.blocks[0:2])


def test_cached_blocks_are_not_evicted_while_uncached_free_blocks_exist() -> None:
    manager = KVCacheManager(BLOCK_SIZE, 10, enable_caching=True)
    pool = manager.block_pool
    a = make_req("a", list(range(100, 112)))  # 3 full blocks, all cached
    compute(manager, a)
    scratch = make_req("s", list(range(300, 302)))  # 1 partial block
    compute(manager, scratch)
    manager.free(a)
    manager.free(scratch)  # uncached: back to the head, ahead of a's cached blocks
    taken = pool.get_new_blocks(7)
    assert {blk.block_id for blk in taken}.isdisjoint({0, 1, 2})
    assert len(pool.cached_block_hash_to_block) == 3
    more = pool.get_new_blocks(1)  # only cached blocks are left: the LRU one goes
    assert more[0].block_id == 2 and len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(taken + more)


def test_failed_allocation_with_a_hit_changes_nothing() -> None:
    manager = KVCacheManager(BLOCK_SIZE, 5, enable_caching=True)
    pool = manager.block_pool
    prefix = list(range(100, 108))
    a = make_req("a", prefix)
    compute(manager, a)
    manager.free(a)  # blocks 0, 1 cached and free
    hog = make_req("hog", list(range(500, 508)))
    compute(manager, hog)  # takes 2 of the 3 uncached blocks
    before = (ref_counts(pool), free_ids(pool), dict(pool.cached_block_hash_to_block))

    b = make_req("b", prefix + list(range(900, 910)))  # hits 2 blocks, needs 3 more: 5 > 3 free
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 8
    assert manager.allocate_slots(b, b.num_tokens - 8, num_hit_tokens, hit_blocks) is None
    assert (ref_counts(pool), free_ids(pool), dict(pool.cached_block_hash_to_block)) == before
    assert "b" not in manager.req_to_blocks
    manager.free(hog)
    assert ref_counts(pool) == [0] * 5


def test_reset_prefix_cache_only_when_no_block_is_in_use() -> None:
    manager = KVCacheManager(BLOCK_SIZE, 8, enable_caching=True)
    prompt = list(range(100, 109))
    a = make_req("a", prompt)
    compute(manager, a)
    manager.record_prefix_cache_lookup(9, 0)
    assert manager.reset_prefix_cache() is False  # a still holds blocks
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert all(blk.block_hash is None for blk in manager.block_pool.blocks)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)
    assert manager.get_computed_blocks(make_req("b", prompt))[1] == 0


# ---------------------------------------------------------------- the scheduler with hits


def test_scheduler_hit_skips_the_cached_prefix_and_reports_it() -> None:
    scheduler, worker = make_scheduler(block_size=4)
    prefix = list(range(100, 108))
    scheduler.add_request(make_request("a", prompt_token_ids=prefix + [1, 2], max_tokens=2))
    run_to_completion(scheduler, worker)
    a_blocks = [n.block_ids for n in worker.new_reqs_seen if n.req_id == "a"][0]

    scheduler.add_request(make_request("b", prompt_token_ids=prefix + [5, 6, 7], max_tokens=2))
    out, outputs = step(scheduler, worker)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens == {"b": 3}
    assert new.block_ids[:2] == a_blocks[:2]
    assert outputs[0].num_cached_tokens == 8
    run = run_to_completion(scheduler, worker)
    assert run.outputs["b"][-1].num_cached_tokens == 8
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)
    assert stats.num_prefill_tokens == 10 + 3  # the 8 cached tokens were not computed


def test_requests_admitted_in_one_step_share_the_blocks_computed_in_it() -> None:
    scheduler, worker = make_scheduler(block_size=4, max_num_batched_tokens=64)
    prompt = list(range(100, 113))  # 3 full blocks + 1
    for req_id in ("a", "b", "c"):
        scheduler.add_request(make_request(req_id, prompt_token_ids=prompt, max_tokens=3))
    out, outputs = step(scheduler, worker)  # FakeWorker checks b and c read a's K/V
    assert out.num_scheduled_tokens == {"a": 13, "b": 1, "c": 1}
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs] == [0, 12, 12]
    assert [o.num_cached_tokens for o in outputs] == [0, 12, 12]
    assert scheduler.kv_cache_manager.block_pool.blocks[0].ref_cnt == 3
    run = run_to_completion(scheduler, worker)
    for req_id in ("a", "b", "c"):
        assert run.tokens(req_id) == [default_token(req_id, 13 + k) for k in range(1, 3)]


def test_a_chunked_prompt_shares_its_finished_chunks_in_the_same_step() -> None:
    scheduler, worker = make_scheduler(block_size=4, max_num_batched_tokens=10, long_prefill_token_threshold=9)
    prompt = list(range(100, 120))
    scheduler.add_request(make_request("a", prompt_token_ids=prompt, max_tokens=1))
    scheduler.add_request(make_request("b", prompt_token_ids=prompt[:9], max_tokens=1))
    out, _ = step(scheduler, worker)  # a: tokens 0-8 (blocks 0, 1 full); b hits them
    assert out.num_scheduled_tokens == {"a": 9, "b": 1}
    assert out.scheduled_new_reqs[1].num_computed_tokens == 8
    run_to_completion(scheduler, worker)


def test_a_hit_is_counted_once_however_long_the_request_waits() -> None:
    scheduler, worker = make_scheduler(num_gpu_blocks=6, block_size=4, max_num_seqs=1)
    prompt = list(range(100, 109))
    scheduler.add_request(make_request("a", prompt_token_ids=prompt, max_tokens=6))
    scheduler.add_request(make_request("b", prompt_token_ids=prompt, max_tokens=1))
    run = run_to_completion(scheduler, worker)  # b waits for a's seat for several steps
    assert run.outputs["b"][-1].num_cached_tokens == 8
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)


def test_preempted_request_resumes_from_its_cached_blocks_with_the_same_tokens() -> None:
    # 7 blocks of 2: a (prompt 6) and b (prompt 6) fill 6; decoding a needs more, so b (the
    # last admitted) is preempted. Its freed prompt blocks stay cached at the back of the free
    # queue, and a's growth takes b's tail first: b resumes past its surviving blocks.
    scheduler, worker = make_scheduler(num_gpu_blocks=7, block_size=2)
    scheduler.add_request(make_request("a", 6, max_tokens=4))
    scheduler.add_request(make_request("b", 6, max_tokens=4))
    run = run_to_completion(scheduler, worker)
    preempted = [r for out in run.scheduler_outputs for r in out.preempted_req_ids]
    assert preempted == ["b"]
    first, resumed = [n for n in worker.new_reqs_seen if n.req_id == "b"]
    assert first.num_computed_tokens == 0
    assert resumed.output_token_ids == [default_token("b", 6)]
    assert resumed.num_computed_tokens > 0, "the resumed request should hit its own cached blocks"
    assert run.tokens("b") == [default_token("b", 6 + k) for k in range(4)]
    assert run.outputs["b"][-1].num_cached_tokens == 0  # reported for the first admission only
    assert scheduler.make_stats().num_preemptions == 1


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_reset_prefix_cache_through_the_scheduler(enable_prefix_caching: bool) -> None:
    scheduler, worker = make_scheduler(block_size=4, enable_prefix_caching=enable_prefix_caching)
    prompt = list(range(100, 109))
    scheduler.add_request(make_request("a", prompt_token_ids=prompt, max_tokens=1))
    run_to_completion(scheduler, worker)
    assert scheduler.reset_prefix_cache() is True
    scheduler.add_request(make_request("b", prompt_token_ids=prompt, max_tokens=1))
    run = run_to_completion(scheduler, worker)
    assert run.outputs["b"][-1].num_cached_tokens == 0
