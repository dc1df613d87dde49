"""The CPU offload tier and swap preemption, scheduler side, without torch: the host LRU, and the
Scheduler + OffloadingConnectorScheduler driven by a fake worker that really moves the harness's
KV fingerprints between its simulated GPU slots and host blocks as the metadata says. Every
position a request attends to must hold its own prefix, so a spill, swap or load that moves the
wrong block (or reuses a block or host slot too early) fails."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import msgspec
import pytest

from minivllm.core.block_pool import BlockPool, hash_request_blocks
from minivllm.core.kv_connector.offloading import HostBlockPool, OffloadingConnectorScheduler, _sort_by_host_block
from minivllm.core.request import RequestStatus
from minivllm.core.scheduler import Scheduler
from minivllm.protocol.kv_transfer import BlockCopy, KVConnectorOutput, OffloadingMetadata
from minivllm.protocol.messages import ModelRunnerOutput
from tests.unit.scheduler_harness import FakeWorker, make_config, make_request, schedulers_in_test
from tests.unit.test_kv_connector import run, tokens

# ---------------------------------------------------------------- the host LRU


def test_host_pool_hands_out_free_slots_then_evicts_least_recently_used() -> None:
    host = HostBlockPool(3)
    slots = host.allocate(3)
    assert sorted(slots) == [0, 1, 2] and host.allocate(1) is None
    for block_hash, slot in zip([b"a", b"b", b"c"], slots):
        host.insert(block_hash, slot, on_gpu=False)
    host.left_gpu(b"a")  # b is now the oldest
    [evicted] = host.allocate(1)
    assert evicted == slots[1] and host.lookup(b"b") is None and host.lookup(b"a") == slots[0]


def test_host_pool_evicts_copies_of_blocks_the_gpu_still_holds_first() -> None:
    host = HostBlockPool(4)
    a, b, c, d = host.allocate(4)
    host.insert(b"a", a, on_gpu=False)  # the oldest, but the host's copy is the only one
    host.insert(b"b", b, on_gpu=True)
    host.insert(b"c", c, on_gpu=True)
    host.insert(b"d", d, on_gpu=False)
    host.left_gpu(b"b")  # evicted from the GPU since: now the tier's own, most recently used
    host.back_on_gpu(b"a")  # loaded back into the GPU: a duplicate again
    assert host.allocate(2) == [c, a]  # the duplicates, oldest first
    assert host.allocate(1) == [d]  # then the least recently used of the rest
    assert host.lookup(b"b") == b and host.num_cached() == 1


def test_host_pool_never_evicts_pinned_slots_and_fails_without_changes() -> None:
    host = HostBlockPool(2)
    a, b = host.allocate(2)
    host.insert(b"a", a, on_gpu=False)
    host.insert(b"b", b, on_gpu=True)
    host.pin([a])
    assert host.allocate(2) is None
    assert host.lookup(b"a") == a and host.lookup(b"b") == b  # nothing evicted by the failed call
    assert host.allocate(1) == [b]
    host.unpin([a])
    assert host.allocate(1) == [a]


def test_host_pool_clear_cache_keeps_what_loads_read() -> None:
    host = HostBlockPool(3)
    a, b, c = host.allocate(3)
    host.insert(b"a", a, on_gpu=False)
    host.insert(b"b", b, on_gpu=True)
    host.pin([b])
    host.free([c])
    host.clear_cache()
    assert host.lookup(b"a") is None and host.lookup(b"b") == b
    assert sorted(host.free_slots) == sorted([a, c])


def test_a_host_block_written_twice_in_one_copy_keeps_its_last_write() -> None:
    """A full host tier can evict a copy made earlier in the same batch and hand its slot out again:
    the slot must end up holding the later block (the one the host cache names), whatever the GPU
    block ids; the earlier write is dropped (it would be overwritten anyway)."""
    copy = BlockCopy(gpu_block_ids=[9, 4, 7, 2], host_block_ids=[3, 5, 1, 3])
    _sort_by_host_block(copy)
    assert copy.host_block_ids == [1, 3, 5] and copy.gpu_block_ids == [7, 2, 4]


# ---------------------------------------------------------------- the scheduler with the tier

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def fake_model(tmp_path_factory) -> str:
    """A config.json whose one block (K and V, every layer) is 32 bytes in float32."""
    path = tmp_path_factory.mktemp("offload-model")
    (path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "hidden_size": 1}))
    return str(path)


@dataclass
class OffloadWorker(FakeWorker):
    """FakeWorker + the offloading connector's worker side over fingerprints. Loads land
    `load_delay` steps after they are issued (0: in the same step, as on CPU). Ahead stores read
    their GPU blocks `store_delay` steps after they are issued, after that step's forward (the
    latest a side stream could), unless something orders them sooner: the stores the forward waits
    for (later on the same stream) or wait_for_ahead_batch. Loads do not wait for them (as on CUDA).
    So a block reused without waiting for its ahead store hands the host another prefix's
    fingerprint, and a load that reads a host block whose store has not run reads a stale one."""

    load_delay: int = 0
    store_delay: int = 1
    host: dict[int, list[int | None]] = field(default_factory=dict)
    loading: list[tuple[str, int]] = field(default_factory=list)
    # Ahead-store batches not read yet, in issue order: [batch, (gpu, host) pairs, steps left].
    pending_ahead: list[list] = field(default_factory=list)

    def _store(self, gpu_block: int, host_block: int) -> None:
        bs = self.scheduler.block_size
        self.host[host_block] = [self.kv_slots.get(gpu_block * bs + i) for i in range(bs)]

    def _complete_ahead(self, through_batch: float) -> None:
        while self.pending_ahead and self.pending_ahead[0][0] <= through_batch:
            for g, h in self.pending_ahead.pop(0)[1]:
                self._store(g, h)

    def execute(self, out) -> ModelRunnerOutput:
        meta = out.kv_connector_metadata
        report = KVConnectorOutput()
        bs = self.scheduler.block_size
        if meta is not None and meta.payload:
            decoded = msgspec.msgpack.decode(meta.payload, type=OffloadingMetadata)
            if decoded.stores:  # the forward waits for these, so for every earlier store too
                self._complete_ahead(float("inf"))
            for copy in decoded.stores:  # before the forward: these blocks are reused in this step
                for g, h in zip(copy.gpu_block_ids, copy.host_block_ids, strict=True):
                    self._store(g, h)
            self._complete_ahead(decoded.wait_for_ahead_batch)
            if decoded.ahead_stores:
                pairs = [pair for copy in decoded.ahead_stores
                         for pair in zip(copy.gpu_block_ids, copy.host_block_ids, strict=True)]
                self.pending_ahead.append([decoded.ahead_batch, pairs, self.store_delay])
            for copy in decoded.loads:
                for g, h in zip(copy.gpu_block_ids, copy.host_block_ids, strict=True):
                    assert h in self.host, f"a load reads host block {h} before any store to it landed"
                    for i, fingerprint in enumerate(self.host[h]):
                        self.kv_slots[g * bs + i] = fingerprint
                self.loading.append((copy.req_id, self.load_delay))
        result = super().execute(out) if out.total_num_scheduled_tokens else ModelRunnerOutput([], [])
        for batch in self.pending_ahead:
            batch[2] -= 1
        while self.pending_ahead and self.pending_ahead[0][2] < 0:  # read after this step's forward
            self._complete_ahead(self.pending_ahead[0][0])
        still = []
        for req_id, delay in self.loading:
            if delay <= 0:
                report.finished_recving.append(req_id)
            else:
                still.append((req_id, delay - 1))
        self.loading = still
        if meta is not None:
            result.kv_connector_output = report
        return result


def make(fake_model: str, num_gpu_blocks: int, num_host_blocks: int | None, load_delay: int = 0,
         store_delay: int = 1, **config) -> tuple[Scheduler, OffloadWorker]:
    if num_host_blocks is not None:
        config["kv_offloading_size"] = num_host_blocks * 32 / (1 << 30)
    settings = dict(model=fake_model, dtype="float32", block_size=BLOCK_SIZE, max_num_batched_tokens=32)
    scheduler = Scheduler(make_config(**{**settings, **config}), num_gpu_blocks=num_gpu_blocks)
    schedulers_in_test.append(scheduler)
    if num_host_blocks is not None:
        assert scheduler.connector.host.num_blocks == num_host_blocks
    return scheduler, OffloadWorker(scheduler, load_delay=load_delay, store_delay=store_delay)


def shared_prefix_requests(n: int, seed: int = 0, prefix_len: int = 24) -> list:
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 400) for _ in range(prefix_len)] for _ in range(3)]
    return [make_request(f"r{i}", prompt_token_ids=prefixes[i % 3] + [rng.randrange(10, 400) for _ in range(1 + i % 7)],
                         max_tokens=8, ignore_eos=True) for i in range(n)]


def run_rounds(scheduler: Scheduler, worker: OffloadWorker, rounds: int, n: int = 9) -> list[dict]:
    results = []
    for round_index in range(rounds):
        for request in shared_prefix_requests(n):
            scheduler.add_request(msgspec.structs.replace(request, request_id=f"{request.request_id}-{round_index}"))
        results.append({k.rsplit("-", 1)[0]: tokens(v) for k, v in run(scheduler, worker, max_steps=5000).items()})
    return results


def assert_host_clean(scheduler: Scheduler) -> None:
    connector: OffloadingConnectorScheduler = scheduler.connector
    host = connector.host
    assert connector.swapped == {} and connector.loading == {} and connector.offers == {} and host.pins == {}
    assert connector.swap_owned == set()
    assert len(host.free_slots) + host.num_cached() == host.num_blocks
    assert len(set(host.free_slots) | set(host.cached_slots())) == host.num_blocks  # no slot twice


def test_a_copy_ahead_batch_never_evicts_its_own_copies(fake_model: str) -> None:
    """On a tier with room for two blocks, three cached GPU blocks next in line for eviction: the
    batch copies the two evicted soonest and stops, rather than evicting the first copy to make
    room for the third (a wasted copy, and the block evicted first left without one)."""
    scheduler, _ = make(fake_model, 8, 2)
    connector: OffloadingConnectorScheduler = scheduler.connector
    pool = scheduler.kv_cache_manager.block_pool
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"first", b"second", b"third"])
    connector.cached_this_step.clear()  # as if copied out already: only the free queue's order counts
    pool.free_blocks(blocks)  # to the free queue's tail, evicted in this order after the 5 uncached
    copy = connector._spill_ahead()
    assert copy is not None and copy.gpu_block_ids == [blocks[0].block_id, blocks[1].block_id]
    assert sorted(copy.host_block_ids) == [0, 1] and connector.host.pins == {}
    assert connector.host.lookup(b"first") is not None and connector.host.lookup(b"second") is not None
    assert connector.host.lookup(b"third") is None


@pytest.fixture(params=["as-queued", "ascending", "descending"])
def allocation_order(request, monkeypatch) -> str:
    """The order in which the block pool hands out one allocation's blocks: the tier must not
    depend on it (other orders put other block ids side by side in its copies; an ascending order
    once exposed a copy that wrote one host block twice in the wrong order)."""
    if request.param != "as-queued":
        real = BlockPool.get_new_blocks
        sign = 1 if request.param == "ascending" else -1
        monkeypatch.setattr(BlockPool, "get_new_blocks",
                            lambda self, n: sorted(real(self, n), key=lambda block: sign * block.block_id))
    return request.param


@pytest.mark.parametrize("load_delay", [0, 2])
@pytest.mark.parametrize("store_delay,copy_ahead", [(0, True), (3, True), (1, False)],
                         ids=["ahead-stores-quick", "ahead-stores-slow", "spill-on-eviction-only"])
def test_spilled_prefixes_come_back_from_the_host_tier(fake_model: str, load_delay: int, store_delay: int,
                                                       copy_ahead: bool, allocation_order: str) -> None:
    # 16 GPU blocks hold about two requests: each round evicts the previous round's prefixes.
    reference_scheduler, reference_worker = make(fake_model, 16, None)
    reference = run_rounds(reference_scheduler, reference_worker, rounds=3)

    scheduler, worker = make(fake_model, 16, 64, load_delay=load_delay, store_delay=store_delay)
    connector: OffloadingConnectorScheduler = scheduler.connector
    connector.copy_ahead = copy_ahead
    results = run_rounds(scheduler, worker, rounds=3)
    assert results == reference
    assert connector.num_spilled > 0 and connector.num_loaded_hits > 0
    # Copying ahead, most blocks reach the host before their eviction; otherwise none does.
    if copy_ahead:
        assert connector.num_spilled_ahead > connector.num_spilled / 2
    else:
        assert connector.num_spilled_ahead == 0
    assert worker.num_computed_tokens_total < reference_worker.num_computed_tokens_total
    assert_host_clean(scheduler)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "v0"])
@pytest.mark.parametrize("load_delay,pipelined", [(0, False), (1, False), (1, True)])
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_swap_preemption_matches_recompute_and_computes_less(fake_model: str, policy: str, load_delay: int,
                                                             pipelined: bool, prefix_caching: bool) -> None:
    def requests():
        return [make_request(f"r{i}", num_prompt_tokens=10 + 3 * i, max_tokens=20, ignore_eos=True, priority=i % 3)
                for i in range(8)]

    budget = {"max_num_batched_tokens": 128} if policy == "v0" else {}
    settings = dict(scheduling_policy=policy, enable_prefix_caching=prefix_caching, max_model_len=128, **budget)
    recompute, recompute_worker = make(fake_model, 20, None, **settings)
    for request in requests():
        recompute.add_request(request)
    expected = {k: tokens(v) for k, v in run(recompute, recompute_worker, max_steps=5000).items()}
    assert recompute.num_preemptions > 0

    scheduler, worker = make(fake_model, 20, 200, load_delay=load_delay, preemption_mode="swap", **settings)
    for request in requests():
        scheduler.add_request(request)
    got = {k: tokens(v) for k, v in run(scheduler, worker, max_steps=5000, pipelined=pipelined).items()}
    assert got == expected
    connector: OffloadingConnectorScheduler = scheduler.connector
    assert scheduler.num_preemptions > 0 and connector.num_swapped_in > 0
    assert worker.num_computed_tokens_total < recompute_worker.num_computed_tokens_total
    # With the prefix cache, full blocks copied ahead are swapped out by pinning, not copied again.
    assert (connector.num_swap_shared > 0) == prefix_caching
    assert_host_clean(scheduler)


def test_swap_without_host_room_falls_back_to_recompute(fake_model: str) -> None:
    scheduler, worker = make(fake_model, 20, 2, preemption_mode="swap", enable_prefix_caching=False)
    for i in range(8):
        scheduler.add_request(make_request(f"r{i}", num_prompt_tokens=10 + 3 * i, max_tokens=20, ignore_eos=True))
    outputs = run(scheduler, worker, max_steps=5000)
    assert all(len(tokens(outputs[f"r{i}"])) == 20 for i in range(8))
    assert scheduler.num_preemptions > 0
    assert_host_clean(scheduler)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_abort_while_swapped_out_and_while_swapping_in_frees_everything(fake_model: str, prefix_caching: bool) -> None:
    scheduler, worker = make(fake_model, 12, 100, load_delay=3, preemption_mode="swap",
                             enable_prefix_caching=prefix_caching)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", num_prompt_tokens=12, max_tokens=16, ignore_eos=True))
    connector: OffloadingConnectorScheduler = scheduler.connector
    aborted_swapped = aborted_loading = False
    for _ in range(400):
        out = scheduler.schedule()
        scheduler.update_from_output(out, worker.execute(out))
        for request_id, request in list(scheduler.requests.items()):
            if not aborted_swapped and request_id in connector.swapped and request.status == RequestStatus.PREEMPTED:
                scheduler.abort_requests([request_id])
                aborted_swapped = True
            elif not aborted_loading and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                scheduler.abort_requests([request_id])
                assert request_id in scheduler.held_blocks  # the load still writes them
                aborted_loading = True
        if aborted_swapped and aborted_loading:
            break
    assert aborted_swapped and aborted_loading
    run(scheduler, worker, max_steps=5000)  # the rest finish; run() checks no block is left held
    assert_host_clean(scheduler)


def test_reset_prefix_cache_empties_the_host_tier(fake_model: str) -> None:
    scheduler, worker = make(fake_model, 16, 64)
    run_rounds(scheduler, worker, rounds=2)
    assert scheduler.connector.host.num_cached()
    assert scheduler.reset_prefix_cache()
    assert not scheduler.connector.host.num_cached()
    assert_host_clean(scheduler)
    # The GPU blocks lost their hashes (no eviction will report their reuse): the next step that
    # reaches the worker waits for every copy made ahead so far.
    connector: OffloadingConnectorScheduler = scheduler.connector
    assert connector.next_ahead_batch > 0
    scheduler.add_request(make_request("after-reset", num_prompt_tokens=9, max_tokens=2, ignore_eos=True))
    out = scheduler.schedule()
    meta = msgspec.msgpack.decode(out.kv_connector_metadata.payload, type=OffloadingMetadata)
    assert meta.wait_for_ahead_batch == connector.next_ahead_batch - 1 - (1 if meta.ahead_stores else 0)
    scheduler.update_from_output(out, worker.execute(out))


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize("load_delay", [0, 1])
def test_loaded_requests_waiting_for_a_seat_never_starve_a_running_one(fake_model: str, load_delay: int,
                                                                       pipelined: bool) -> None:
    """Requests whose KV came back from the host hold blocks while they wait to be scheduled. A
    running request that needs one of those blocks must get it (they give it up and load again
    later) rather than preempt itself over and over."""
    import random

    rng = random.Random(0)
    prefixes = [[rng.randrange(10, 400) for _ in range(24)] for _ in range(4)]
    prompts = [prefixes[i % 4] + [rng.randrange(10, 400) for _ in range(1 + rng.randrange(20))] for i in range(12)]
    reference, reference_worker = make(fake_model, 24, None)
    scheduler, worker = make(fake_model, 24, 500, load_delay=load_delay)
    for round_index in range(2):
        for sched, work, results in ((reference, reference_worker, expected := {}), (scheduler, worker, got := {})):
            for i, prompt in enumerate(prompts):
                sched.add_request(make_request(f"r{i}-{round_index}", prompt_token_ids=prompt, max_tokens=16,
                                               ignore_eos=True))
            results.update({k: tokens(v) for k, v in run(sched, work, max_steps=3000, pipelined=pipelined).items()})
        assert got == expected
    assert scheduler.connector.num_loaded_hits > 0
    assert_host_clean(scheduler)


def test_a_load_from_a_block_copied_ahead_waits_for_that_copy(fake_model: str) -> None:
    """A prefix's first block leaves the GPU while a later one stays (its copy made ahead, in a
    later batch than the first's, and not waited for by any eviction): a request that loads them
    from the host must wait for the later copy too, or it reads a stale host block."""
    prompt = list(range(10, 58))  # 12 blocks: computed in two chunks (budget 32), copied in two batches
    scheduler, worker = make(fake_model, 32, 64, store_delay=1000)  # copies never land by themselves
    connector: OffloadingConnectorScheduler = scheduler.connector
    scheduler.add_request(make_request("a", prompt_token_ids=prompt, max_tokens=2, ignore_eos=True))
    run(scheduler, worker)
    assert connector.next_ahead_batch >= 2 and worker.pending_ahead

    scheduler.add_request(make_request("b", prompt_token_ids=prompt, max_tokens=2, ignore_eos=True))
    pool = scheduler.kv_cache_manager.block_pool
    first = pool.get_cached_block(hash_request_blocks(prompt, BLOCK_SIZE)[0])
    pool.free_block_queue.remove(first)  # evict only the first block, as allocation would
    pool._evict(first)
    pool.free_block_queue.appendleft(first)
    assert len(tokens(run(scheduler, worker)["b"])) == 2  # and it attended to its own prefix (the worker checks)
    assert connector.num_loaded_hits == len(prompt) // BLOCK_SIZE - 1  # all but the last block's logits
