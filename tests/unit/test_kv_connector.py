"""The Scheduler's side of the KV connector contract (core/kv_connector/base.py), without torch.

A test connector plays an outside KV store (another engine's prompts): its scheduler side offers
the KV of prompts it "holds", its simulated worker side writes that KV (the harness's prefix
fingerprints) into the request's blocks some steps later and reports the load. The FakeWorker
then checks that every position a request attends to holds its own prefix, so a load into the
wrong blocks, or blocks handed to someone else while loading, fails the test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest

from minivllm.core.kv_connector import KVConnectorSchedulerBase
from minivllm.core.request import RequestStatus
from minivllm.protocol.config import KVTransferConfig
from minivllm.protocol.kv_transfer import KV_CONNECTORS, KVConnectorOutput, register_kv_connector
from minivllm.protocol.messages import ERROR_KV_TRANSFER, FINISH_ABORT, ModelRunnerOutput
from tests.unit.scheduler_harness import FakeWorker, WorkerRequestState, cdiv, make_config, make_request, schedulers_in_test

from minivllm.core.scheduler import Scheduler


class LoadOp(msgspec.Struct, array_like=True):
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    num_tokens: int
    load_async: bool


class RemoteMeta(msgspec.Struct):
    loads: list[LoadOp] = []
    finished: list[str] = []


class RemoteStoreScheduler(KVConnectorSchedulerBase):
    """Offers the KV of every prompt token (but the last) when kv_transfer_params has
    {"remote": true}; a finished request with {"send": true} keeps its blocks until sent."""

    def __init__(self, config, num_gpu_blocks) -> None:
        super().__init__(config, num_gpu_blocks)
        extra = config.kv_transfer_config.kv_connector_extra_config
        self.load_async = extra.get("load_async", True)
        self.pending_loads: list[LoadOp] = []
        self.finished: list[str] = []
        self.preempted: list[str] = []

    def validate_kv_transfer_params(self, request) -> None:
        params = request.kv_transfer_params
        keys = {"remote", "send", "first_token"}
        if params is not None and not set(params) <= keys:
            raise ValueError(f"unknown kv_transfer_params keys: {sorted(set(params) - keys)}")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not (request.kv_transfer_params or {}).get("remote") or request.num_output_tokens:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, self.load_async  # the scheduler clamps it

    def first_output_token(self, request):
        if request.num_output_tokens or request.sampling_params.logprobs is not None:
            return None
        return (request.kv_transfer_params or {}).get("first_token")

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.pending_loads.append(LoadOp(request.request_id, request.all_token_ids, block_ids,
                                         request.num_computed_tokens, num_external_tokens, self.load_async))

    def request_preempted(self, request, block_ids, num_computed_tokens):
        self.preempted.append(request.request_id)

    def build_connector_meta(self, scheduler_output):
        if not self.pending_loads and not self.finished:
            return None
        meta = RemoteMeta(self.pending_loads, self.finished)
        self.pending_loads, self.finished = [], []
        return meta

    def request_finished(self, request, block_ids):
        send = bool((request.kv_transfer_params or {}).get("send"))
        if send and request.status != RequestStatus.FINISHED_ABORTED:
            self.finished.append(request.request_id)
            return True, {"remote": True, "blocks": block_ids}
        return False, None


register_kv_connector("TestRemoteStore", f"{__name__}:RemoteStoreScheduler", "unused:unused")


@dataclass
class ConnectorWorker(FakeWorker):
    """FakeWorker + the test connector's worker side: loads land `load_steps` steps after they
    start (or before the forward, for synchronous ones); sends finish `send_steps` steps after."""

    load_steps: int = 2
    send_steps: int = 2
    fail: set[str] = field(default_factory=set)
    loading: dict[str, tuple[LoadOp, int]] = field(default_factory=dict)
    sending: dict[str, int] = field(default_factory=dict)
    expired: list[str] = field(default_factory=list)

    def _load(self, op: LoadOp, start: int) -> None:
        block_size = self.scheduler.block_size
        state = WorkerRequestState(token_ids=op.token_ids, block_ids=op.block_ids, num_computed_tokens=0)
        for position in range(start, start + op.num_tokens):
            slot = op.block_ids[position // block_size] * block_size + position % block_size
            self.kv_slots[slot] = state.fingerprint(position)

    def execute(self, out) -> ModelRunnerOutput:
        meta = out.kv_connector_metadata
        report = KVConnectorOutput()
        if meta is not None:
            self.expired += meta.expired_req_ids
            for req_id in meta.expired_req_ids:
                self.loading.pop(req_id, None)
                self.sending.pop(req_id, None)
            decoded = msgspec.msgpack.decode(meta.payload, type=RemoteMeta) if meta.payload else RemoteMeta()
            for op in decoded.loads:
                if op.load_async:
                    self.loading[op.req_id] = (op, self.load_steps)
                else:  # synchronous: lands before the forward
                    self._load(op, op.start)
            for req_id in decoded.finished:
                self.sending[req_id] = self.send_steps
        result = super().execute(out) if out.total_num_scheduled_tokens else ModelRunnerOutput([], [])
        for req_id, (op, steps) in list(self.loading.items()):
            if steps <= 1:
                del self.loading[req_id]
                if req_id in self.fail:
                    report.failed_recving.append(req_id)
                else:
                    self._load(op, op.start)
                    report.finished_recving.append(req_id)
            else:
                self.loading[req_id] = (op, steps - 1)
        for req_id, steps in list(self.sending.items()):
            if steps <= 1:
                del self.sending[req_id]
                report.finished_sending.append(req_id)
            else:
                self.sending[req_id] = steps - 1
        if meta is not None:
            result.kv_connector_output = report
        return result


def make(num_gpu_blocks: int = 64, **extra) -> tuple[Scheduler, ConnectorWorker]:
    config = make_config(kv_transfer_config=KVTransferConfig(kv_connector="TestRemoteStore",
                                                             kv_connector_extra_config=extra))
    scheduler = Scheduler(config, num_gpu_blocks=num_gpu_blocks)
    schedulers_in_test.append(scheduler)
    return scheduler, ConnectorWorker(scheduler)


def run(scheduler: Scheduler, worker: ConnectorWorker, max_steps: int = 500, on_step=None,
        pipelined: bool = False) -> dict[str, list]:
    """Step as the EngineCore does (a step carrying metadata reaches the worker even with no
    tokens); check the block accounting every step; return the outputs by request. pipelined: as
    with async scheduling, step N+1 is scheduled (and run) before the scheduler sees step N's output."""
    outputs: dict[str, list] = {}
    in_flight: list = []
    empty = ModelRunnerOutput([], [])
    for i in range(max_steps):
        if not scheduler.has_unfinished_requests() and not in_flight:
            break
        if on_step is not None:
            on_step(i)
        submitted = False
        results = []
        if scheduler.has_unfinished_requests() and len(in_flight) < 2:
            out = scheduler.schedule()
            check_accounting(scheduler)
            if out.total_num_scheduled_tokens or out.kv_connector_metadata is not None:
                in_flight.append((out, worker.execute(out)))
                submitted = True
            else:
                results = scheduler.update_from_output(out, empty)
        if in_flight and (not pipelined or not submitted or len(in_flight) == 2):
            out, result = in_flight.pop(0)
            results += scheduler.update_from_output(out, result)
        for o in results:
            outputs.setdefault(o.request_id, []).append(o)
    else:
        raise AssertionError("did not finish")
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks, "blocks leaked"
    assert scheduler.held_blocks == {} and scheduler.waiting_for_remote_kvs == {}
    return outputs


def check_accounting(scheduler: Scheduler) -> None:
    """Every block's ref count is the number of holders: running, waiting (loaded), loading, held."""
    manager = scheduler.kv_cache_manager
    holders: dict[int, int] = {}
    for request in [*scheduler.running, *scheduler.waiting, *scheduler.waiting_for_remote_kvs.values()]:
        block_ids = manager.get_block_ids(request.request_id)
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert len(block_ids) == cdiv(request.num_computed_tokens + request.num_loading_tokens, scheduler.block_size)
        elif request.status != RequestStatus.RUNNING:
            assert len(block_ids) == cdiv(request.num_computed_tokens, scheduler.block_size)
        for block_id in block_ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    for blocks, _ in scheduler.held_blocks.values():
        for block in blocks:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
    for block in manager.block_pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), block


def tokens(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


@pytest.mark.parametrize("load_async", [True, False])
def test_loaded_kv_is_used_and_output_matches_local_compute(load_async: bool) -> None:
    prompt = list(range(100, 137))  # 37 tokens: 9 full blocks and one partial
    scheduler, worker = make(load_async=load_async)
    scheduler.add_request(make_request("local", prompt_token_ids=prompt, max_tokens=5, ignore_eos=True))
    local = run(scheduler, worker)
    computed_locally = worker.num_computed_tokens_total

    scheduler, worker = make(load_async=load_async)
    scheduler.add_request(with_params("r", {"remote": True}, prompt_token_ids=prompt, max_tokens=5, ignore_eos=True))
    seen_waiting = []
    remote = run(scheduler, worker, on_step=lambda i: seen_waiting.append(bool(scheduler.waiting_for_remote_kvs)))
    # The same tokens (the fake model's token depends on the request id and position only)...
    assert len(tokens(remote["r"])) == len(tokens(local["local"])) == 5
    # ...but only the last prompt token and the outputs were computed here.
    assert worker.num_computed_tokens_total == computed_locally - (len(prompt) - 1)
    assert remote["r"][-1].num_cached_tokens == len(prompt) - 1
    assert any(seen_waiting) == load_async


def with_params(request_id: str, params: dict | None, logprobs: int | None = None, **kwargs):
    request = make_request(request_id, **kwargs)
    if logprobs is not None:
        request.sampling_params.logprobs = logprobs
    return msgspec.structs.replace(request, kv_transfer_params=params)


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_a_load_that_brings_the_first_output_token_decodes_from_it(max_tokens: int) -> None:
    """As PD's consumer does with the token the prefill sampled: the whole prompt's KV is loaded,
    the token is reported when the load lands, and decoding starts from it (no forward of the
    last prompt token here); max_tokens=1 finishes on it and frees the blocks."""
    prompt = list(range(100, 137))
    scheduler, worker = make(load_steps=3)
    scheduler.add_request(with_params("r", {"remote": True, "first_token": 7}, prompt_token_ids=prompt,
                                      max_tokens=max_tokens, ignore_eos=True))
    outputs = run(scheduler, worker)["r"]
    assert outputs[0].new_token_ids == [7] and len(tokens(outputs)) == max_tokens
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_cached_tokens == len(prompt)
    assert worker.num_computed_tokens_total == max_tokens - 1  # the outputs fed back, nothing of the prompt

    # Logprobs are not in what the load brings: the last prompt token is computed here for them.
    scheduler, worker = make()
    scheduler.add_request(with_params("r", {"remote": True, "first_token": 7}, logprobs=0, prompt_token_ids=prompt,
                                      max_tokens=max_tokens, ignore_eos=True))
    outputs = run(scheduler, worker)["r"]
    assert 7 not in tokens(outputs) and len(tokens(outputs)) == max_tokens
    assert worker.num_computed_tokens_total == max_tokens


def test_bad_kv_transfer_params_refuse_that_request_only() -> None:
    scheduler, worker = make()
    with pytest.raises(ValueError, match="unknown kv_transfer_params keys"):
        scheduler.add_request(with_params("bad", {"evil": 1}, num_prompt_tokens=5))
    scheduler.add_request(with_params("good", {"remote": True}, num_prompt_tokens=9))
    outputs = run(scheduler, worker)
    assert len(tokens(outputs["good"])) == 4 and "bad" not in outputs


def test_many_loading_requests_under_block_pressure_never_leak() -> None:
    scheduler, worker = make(num_gpu_blocks=24)  # 96 tokens: loads and running requests compete
    for i in range(12):
        params = {"remote": True} if i % 2 == 0 else None
        scheduler.add_request(with_params(f"r{i}", params, num_prompt_tokens=10 + 3 * i, max_tokens=6, ignore_eos=True))
    outputs = run(scheduler, worker, max_steps=2000)
    assert all(len(tokens(outputs[f"r{i}"])) == 6 for i in range(12))


def test_abort_while_loading_holds_the_blocks_until_the_load_lands() -> None:
    scheduler, worker = make()
    worker.load_steps = 3
    scheduler.add_request(with_params("r", {"remote": True}, num_prompt_tokens=20))
    out = scheduler.schedule()
    assert scheduler.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    scheduler.update_from_output(out, worker.execute(out))
    [aborted] = scheduler.abort_requests(["r"])
    assert aborted.finish_reason == FINISH_ABORT
    assert "r" in scheduler.held_blocks  # the worker still writes them
    free_before = scheduler.kv_cache_manager.get_num_free_blocks()
    run(scheduler, worker)  # polls the worker until the load reports
    assert scheduler.kv_cache_manager.get_num_free_blocks() > free_before


def test_failed_load_finishes_the_request_with_an_error() -> None:
    scheduler, worker = make()
    worker.fail = {"r"}
    scheduler.add_request(with_params("r", {"remote": True}, num_prompt_tokens=20))
    scheduler.add_request(with_params("other", None, num_prompt_tokens=8))
    outputs = run(scheduler, worker)
    [failed] = outputs["r"]
    assert failed.error_type == ERROR_KV_TRANSFER and failed.finish_reason == FINISH_ABORT
    assert len(tokens(outputs["other"])) == 4


def test_load_timeout_fails_the_request_and_tells_the_worker(monkeypatch) -> None:
    scheduler, worker = make(transfer_timeout_s=5)
    worker.load_steps = 10**9  # never lands: a dead peer
    clock = [1000.0]
    monkeypatch.setattr("minivllm.core.scheduler.time.monotonic", lambda: clock[0])
    scheduler.add_request(with_params("r", {"remote": True}, num_prompt_tokens=20))

    def tick(i: int) -> None:
        clock[0] += 1.0

    outputs = run(scheduler, worker, on_step=tick)
    [failed] = outputs["r"]
    assert failed.error_type == ERROR_KV_TRANSFER and "did not arrive within 5 s" in failed.error
    assert worker.expired == ["r"] and worker.loading == {}


def test_delayed_free_until_sent_and_kv_transfer_params_returned() -> None:
    scheduler, worker = make()
    worker.send_steps = 3
    scheduler.add_request(with_params("p", {"send": True}, num_prompt_tokens=10, max_tokens=1))
    outputs = run(scheduler, worker)
    assert outputs["p"][-1].kv_transfer_params["remote"] is True
    assert outputs["p"][-1].finish_reason == "length"


def test_delayed_free_times_out(monkeypatch) -> None:
    scheduler, worker = make(transfer_timeout_s=3)
    worker.send_steps = 10**9  # the consumer never pulls
    clock = [0.0]
    monkeypatch.setattr("minivllm.core.scheduler.time.monotonic", lambda: clock[0])
    scheduler.add_request(with_params("p", {"send": True}, num_prompt_tokens=10, max_tokens=1))

    def tick(i: int) -> None:
        clock[0] += 1.0

    run(scheduler, worker, on_step=tick)
    assert worker.expired == ["p"]


def test_request_id_reuse_while_blocks_are_held_is_refused() -> None:
    scheduler, worker = make()
    worker.send_steps = 50
    scheduler.add_request(with_params("p", {"send": True}, num_prompt_tokens=10, max_tokens=1))
    for _ in range(3):
        out = scheduler.schedule()
        scheduler.update_from_output(out, worker.execute(out))
    assert "p" in scheduler.held_blocks
    with pytest.raises(ValueError, match="still in use"):
        scheduler.add_request(with_params("p", None, num_prompt_tokens=5))
    run(scheduler, worker)


def test_preemption_is_reported_to_the_connector() -> None:
    scheduler, worker = make(num_gpu_blocks=12)
    for i in range(4):
        scheduler.add_request(with_params(f"r{i}", None, num_prompt_tokens=12, max_tokens=12, ignore_eos=True))
    run(scheduler, worker, max_steps=2000)
    assert scheduler.connector.preempted and scheduler.num_preemptions == len(scheduler.connector.preempted)


def test_no_connector_means_no_metadata() -> None:
    assert "TestRemoteStore" in KV_CONNECTORS
    scheduler = Scheduler(make_config(), num_gpu_blocks=16)
    schedulers_in_test.append(scheduler)
    assert scheduler.connector is None
    scheduler.add_request(with_params("r", {"remote": True}, num_prompt_tokens=5))  # ignored: no connector
    worker = FakeWorker(scheduler)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        assert out.kv_connector_metadata is None
        scheduler.update_from_output(out, worker.execute(out))


def test_blocks_being_loaded_are_not_shared_before_the_kv_arrives() -> None:
    prompt = list(range(300, 333))
    scheduler, worker = make()
    worker.load_steps = 4
    scheduler.add_request(with_params("loading", {"remote": True}, prompt_token_ids=prompt, max_tokens=3))
    out = scheduler.schedule()
    scheduler.update_from_output(out, worker.execute(out))
    # Same prefix, computed here, while the first one's KV is still on its way: a prefix-cache
    # hit on the blocks being loaded would read KV that is not there yet (the worker checks).
    scheduler.add_request(with_params("local", None, prompt_token_ids=prompt, max_tokens=3))
    outputs = run(scheduler, worker)
    assert outputs["local"][-1].num_cached_tokens == 0
    assert len(tokens(outputs["loading"])) == 3
