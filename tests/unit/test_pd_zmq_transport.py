"""The KV block transports between two 'instances' (two sets of KV cache tensors in one process,
real sockets): ZMQ/TCP raw frames, and device-to-device point-to-point (the P2pNcclConnector's;
NCCL between GPUs, here gloo on CPU). Blocks arrive where they were allocated, errors are clear,
holds expire, cancelled pulls leave no trace."""

from __future__ import annotations

import time

import pytest
import torch

from minivllm.worker.kv_connector import pd_nccl_transport
from minivllm.worker.kv_connector.pd_nccl_transport import NcclBlockPuller, NcclBlockServer
from minivllm.worker.kv_connector.pd_zmq_transport import KVBlockPuller, KVBlockServer, PullJob
from tests.pd_procs import wait_for_pull as wait_for, wait_for_release
from tests.server_procs import free_port

TRANSPORTS = {"zmq": (KVBlockServer, KVBlockPuller), "p2p": (NcclBlockServer, NcclBlockPuller)}


@pytest.fixture(params=list(TRANSPORTS))
def transport(request) -> tuple[type, type]:
    return TRANSPORTS[request.param]


SHAPE = (2, 8, 4, 2, 8)  # [K/V, num_blocks, block_size, num_kv_heads, head_dim]


def make_caches(dtype: torch.dtype | str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three layers' caches of a producer (random) and a consumer (zeros); "fp8": the packed
    [2, num_blocks, bytes] layout of kv_cache_dtype="fp8"."""
    if dtype == "fp8":
        from minivllm.worker.attention.kv_cache import KVCacheLayout

        layout = KVCacheLayout(SHAPE[2], SHAPE[3], SHAPE[4], torch.float32, fp8=True)
        producer = layers(torch.randint(0, 120, (3, *layout.shape(SHAPE[1])), dtype=torch.uint8))
        return producer, layout.allocate_layers(3, SHAPE[1], torch.device("cpu"))
    return layers(torch.randn(3, *SHAPE).to(dtype)), layers(torch.zeros(3, *SHAPE, dtype=dtype))


def layers(stacked: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer caches as views of one tensor, as a worker allocates them (the p2p transport needs that)."""
    return list(stacked.unbind(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp8"])
def test_blocks_move_into_the_allocated_blocks(transport, dtype: torch.dtype | str) -> None:
    server_class, puller_class = transport
    producer, consumer = make_caches(dtype)
    port = free_port()
    server = server_class(producer, "127.0.0.1", port)
    puller = puller_class(consumer, timeout_s=5.0)
    try:
        server.hold("p1", [5, 1, 6])
        puller.start(PullJob("d1", "p1", f"tcp://127.0.0.1:{port}", [5, 1, 6], [2, 7, 0]))
        assert wait_for(puller) == ({"d1"}, {})
        for mine, theirs in zip(consumer, producer):
            assert torch.equal(mine[:, [2, 7, 0]], theirs[:, [5, 1, 6]])
            assert not mine[:, [1, 3, 4, 5, 6]].any()  # nothing else was touched
        assert wait_for_release(server, {"p1"}) == {"p1"}
        # a second pull of the same request: refused clearly (its blocks are gone)
        puller.start(PullJob("d2", "p1", f"tcp://127.0.0.1:{port}", [5, 1, 6], [2, 7, 0]))
        done, failed = wait_for(puller)
        assert not done and "holds no KV for the request" in failed["d2"]
    finally:
        puller.close()
        server.close()


def test_a_silent_producer_fails_the_pull_after_the_timeout(transport) -> None:
    consumer = layers(torch.zeros(1, *SHAPE))
    puller = transport[1](consumer, timeout_s=0.5)
    try:
        start = time.monotonic()
        puller.start(PullJob("d1", "p1", f"tcp://127.0.0.1:{free_port()}", [1], [2]))
        done, failed = wait_for(puller)
        assert not done and "for 0.5 s" in failed["d1"] and "may have died" in failed["d1"]
        assert time.monotonic() - start < 5
    finally:
        puller.close()


def test_held_blocks_nobody_pulls_are_released_after_the_hold_timeout() -> None:
    server = KVBlockServer(layers(torch.zeros(1, *SHAPE)), "127.0.0.1", free_port(), hold_timeout_s=0.3)
    try:
        server.hold("p1", [1, 2])
        assert server.take_released() == set()
        time.sleep(0.5)
        assert server.take_released() == {"p1"}
    finally:
        server.close()


def test_a_cancelled_pull_writes_nothing_and_reports_nothing(transport) -> None:
    """The scheduler gave up on a request (its blocks went to others): its pull stops writing."""
    server_class, puller_class = transport
    producer = layers(torch.randn(1, *SHAPE))
    consumer = layers(torch.zeros(1, *SHAPE))
    port = free_port()
    server = server_class(producer, "127.0.0.1", port)
    puller = puller_class(consumer, timeout_s=5.0)
    try:
        server.hold("p1", [1, 2])
        puller.cancel(["d1"])
        puller.start(PullJob("d1", "p1", f"tcp://127.0.0.1:{port}", [1, 2], [3, 4]))
        server.hold("p2", [5])
        puller.start(PullJob("d2", "p2", f"tcp://127.0.0.1:{port}", [5], [6]))
        assert wait_for(puller) == ({"d2"}, {})  # the later job ran; the cancelled one left no trace
        assert not consumer[0][:, [3, 4]].any() and torch.equal(consumer[0][:, 6], producer[0][:, 5])
        server.drop(["p1"])
        assert "p1" not in server.take_released()
    finally:
        puller.close()
        server.close()


def test_p2p_moves_many_layers_in_chunks_through_two_staging_buffers(monkeypatch) -> None:
    """Small chunks: 7 layers go 2 at a time (4 chunks through 2 buffers in turn), each landing in
    its own layer; a second consumer gets its own pair group from the same producer."""
    layer_bytes = 2 * 3 * 4 * 2 * 8 * 4  # K and V of 3 blocks, fp32
    monkeypatch.setattr(pd_nccl_transport, "CHUNK_BYTES", 2 * layer_bytes)
    producer = layers(torch.randn(7, *SHAPE))
    consumers = [layers(torch.zeros(7, *SHAPE)) for _ in range(2)]
    port = free_port()
    server = NcclBlockServer(producer, "127.0.0.1", port)
    pullers = [NcclBlockPuller(consumer, timeout_s=5.0) for consumer in consumers]
    try:
        for i, puller in enumerate(pullers):
            server.hold(f"p{i}", [4, 0, 3])
            puller.start(PullJob(f"d{i}", f"p{i}", f"tcp://127.0.0.1:{port}", [4, 0, 3], [1, 2, 5]))
            assert wait_for(puller) == ({f"d{i}"}, {})
        assert len(server.groups) == 2
        for consumer in consumers:
            for mine, theirs in zip(consumer, producer):
                assert torch.equal(mine[:, [1, 2, 5]], theirs[:, [4, 0, 3]])
                assert not mine[:, [0, 3, 4, 6, 7]].any()
    finally:
        for puller in pullers:
            puller.close()
        server.close()


def test_p2p_a_producer_gone_after_the_pair_was_made_fails_the_pull_then_a_new_one_serves() -> None:
    """The producer's process group side vanishes (its instance restarted at the same address): the
    pull fails with a clear error, and the next pull builds a fresh pair group and succeeds."""
    producer = layers(torch.randn(1, *SHAPE))
    consumer = layers(torch.zeros(1, *SHAPE))
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    server = NcclBlockServer(producer, "127.0.0.1", port)
    puller = NcclBlockPuller(consumer, timeout_s=1.0)
    try:
        server.hold("p1", [1])
        puller.start(PullJob("d1", "p1", address, [1], [2]))
        assert wait_for(puller) == ({"d1"}, {})
        server.close()
        server.hold("p2", [3])
        puller.start(PullJob("d2", "p2", address, [3], [4]))
        done, failed = wait_for(puller)
        assert not done and "may have died" in failed["d2"] and not consumer[0][:, 4].any()
        server = NcclBlockServer(producer, "127.0.0.1", port)
        server.hold("p3", [3])
        puller.start(PullJob("d3", "p3", address, [3], [4]))
        assert wait_for(puller) == ({"d3"}, {})
        assert torch.equal(consumer[0][:, 4], producer[0][:, 3])
    finally:
        puller.close()
        server.close()
