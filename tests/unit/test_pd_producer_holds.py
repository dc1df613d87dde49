"""A prefill instance's scheduler side of PD (core/kv_connector/pd_connector.py) with the real
Scheduler: its workers are told to serve a prefill's blocks in the step that completes the prompt,
not a step after the request finished (on a loaded producer that is a whole prefill step sooner
for the decode instance's pull); an aborted or preempted prefill releases that hold."""

from __future__ import annotations

import msgspec

from minivllm.core.kv_connector.pd_connector import PDConnectorMetadata, SendSpec
from minivllm.core.scheduler import Scheduler
from minivllm.protocol.config import KVTransferConfig
from minivllm.protocol.kv_transfer import KVConnectorOutput
from minivllm.protocol.messages import ModelRunnerOutput, SchedulerOutput
from tests.unit.scheduler_harness import FakeWorker, make_config, make_request, schedulers_in_test

PROMPT = 40  # 10 blocks of 4 tokens; 16 tokens a step: computed over three steps


def producer(num_gpu_blocks: int = 64) -> tuple[Scheduler, FakeWorker]:
    config = make_config(max_num_batched_tokens=16,
                         kv_transfer_config=KVTransferConfig(kv_connector="P2pNcclConnector", kv_role="kv_producer"))
    scheduler = Scheduler(config, num_gpu_blocks=num_gpu_blocks)
    schedulers_in_test.append(scheduler)
    return scheduler, FakeWorker(scheduler)


def prefill(request_id: str, num_prompt_tokens: int = PROMPT):
    request = make_request(request_id, num_prompt_tokens=num_prompt_tokens, max_tokens=1)
    return msgspec.structs.replace(request, kv_transfer_params={"do_remote_decode": True})


def metadata(out: SchedulerOutput) -> PDConnectorMetadata:
    meta = out.kv_connector_metadata
    if meta is None or not meta.payload:
        return PDConnectorMetadata()
    return msgspec.msgpack.decode(meta.payload, type=PDConnectorMetadata)


def test_blocks_are_served_from_the_step_that_completes_the_prompt() -> None:
    scheduler, worker = producer()
    scheduler.add_request(prefill("p"))
    sends, answer = [], None
    for _ in range(3):
        out = scheduler.schedule()
        sends.append(metadata(out).reqs_to_send)
        if sends[-1]:
            assert scheduler.requests["p"].num_computed_tokens == PROMPT  # this very step completes it
            prompt_blocks = scheduler.kv_cache_manager.get_block_ids("p")[:10]
        outputs = scheduler.update_from_output(out, worker.execute(out))
        answer = answer or next((o.kv_transfer_params for o in outputs if o.kv_transfer_params), None)
    assert sends == [[], [], [SendSpec("p", prompt_blocks)]]
    assert answer["remote_block_ids"] == prompt_blocks and answer["do_remote_prefill"] is True
    # Finished: the blocks stay until the worker reports them sent; no second hold is sent.
    assert "p" in scheduler.held_blocks
    out = scheduler.schedule()
    assert metadata(out).reqs_to_send == []
    sent = ModelRunnerOutput([], [], kv_connector_output=KVConnectorOutput(finished_sending=["p"]))
    scheduler.update_from_output(out, sent)
    assert scheduler.held_blocks == {}


def test_an_abort_after_the_hold_releases_it_before_the_blocks_are_reused() -> None:
    scheduler, worker = producer()
    scheduler.add_request(prefill("a"))
    for _ in range(2):
        out = scheduler.schedule()
        scheduler.update_from_output(out, worker.execute(out))
    out = scheduler.schedule()
    assert [s.req_id for s in metadata(out).reqs_to_send] == ["a"]
    scheduler.abort_requests(["a"])  # before that step's output came back (its token is dropped)
    scheduler.update_from_output(out, ModelRunnerOutput([], []))
    scheduler.add_request(prefill("b", 8))
    out = scheduler.schedule()
    # The worker drops the hold before this step's forward, which may write b's KV into a's blocks.
    assert metadata(out).reqs_to_release == ["a"] and scheduler.held_blocks == {}
    assert [s.req_id for s in metadata(out).reqs_to_send] == ["b"]
    scheduler.update_from_output(out, ModelRunnerOutput(["b"], [7]))
    assert not scheduler.requests and "b" in scheduler.held_blocks
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(
        [], [], kv_connector_output=KVConnectorOutput(finished_sending=["b"])))
    assert scheduler.held_blocks == {}


def test_a_prefill_preempted_after_its_hold_releases_it_and_is_held_again_once_recomputed() -> None:
    """q arrived first, so when the two outgrow the 12 blocks, p (prompt 36, decoding past it:
    max_tokens 12) is preempted after its hold, and recomputed later."""
    scheduler, worker = producer(num_gpu_blocks=12)
    scheduler.add_request(make_request("q", num_prompt_tokens=8, max_tokens=20, ignore_eos=True))
    request = make_request("p", num_prompt_tokens=36, max_tokens=12, ignore_eos=True)
    scheduler.add_request(msgspec.structs.replace(request, kv_transfer_params={"do_remote_decode": True}))
    events = []
    for _ in range(100):
        if not scheduler.requests:
            break
        out = scheduler.schedule()
        meta = metadata(out)
        events += [("hold", s.req_id) for s in meta.reqs_to_send] + [("release", r) for r in meta.reqs_to_release]
        events += [("preempted", r) for r in out.preempted_req_ids]
        scheduler.update_from_output(out, worker.execute(out))
    assert not scheduler.requests
    assert events[:2] == [("hold", "p"), ("release", "p")] and ("preempted", "p") in events
    assert events[-1] == ("hold", "p") and scheduler.num_preemptions >= 1
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(
        [], [], kv_connector_output=KVConnectorOutput(finished_sending=["p"])))
    assert scheduler.held_blocks == {}
