"""The P2pNcclConnector's transport between two GPUs (a producer's cache on cuda:0, a consumer's on
cuda:1, in one process): blocks move over NCCL into the allocated blocks, in several chunks, bf16
and FP8-packed; a consumer that abandons a pull leaves the producer serving the next one. Prints
the transfer rate (the figure itself belongs to the benchmarks)."""

from __future__ import annotations

import time

import pytest
import torch

from minivllm.worker.kv_connector import pd_nccl_transport
from minivllm.worker.kv_connector.pd_nccl_transport import NcclBlockPuller, NcclBlockServer
from minivllm.worker.kv_connector.pd_zmq_transport import PullJob
from tests.pd_procs import wait_for_pull, wait_for_release
from tests.server_procs import free_port

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

NUM_LAYERS, NUM_BLOCKS, BLOCK_SHAPE = 28, 1024, (16, 8, 128)  # the Qwen3-0.6B shape's KV


def wait_for(puller: NcclBlockPuller) -> tuple[set[str], dict[str, str]]:
    return wait_for_pull(puller, timeout=60.0, interval=0.001)  # (fine-grained: the transfer is timed)


def caches(device: str, dtype: torch.dtype, fill: bool) -> list[torch.Tensor]:
    """Views of one tensor, as KVCacheLayout.allocate_layers makes them (the transport needs that)."""
    shape = (NUM_LAYERS, 2, NUM_BLOCKS, *BLOCK_SHAPE)
    if dtype == torch.uint8:  # the FP8 cache's packed rows
        shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SHAPE[0] * BLOCK_SHAPE[1] * (BLOCK_SHAPE[2] + 2))
        stacked = torch.randint(0, 255, shape, dtype=dtype, device=device) if fill else \
            torch.zeros(shape, dtype=dtype, device=device)
    else:
        stacked = torch.randn(shape, device=device).to(dtype) if fill else torch.zeros(shape, dtype=dtype, device=device)
    return list(stacked.unbind(0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_blocks_move_gpu_to_gpu_over_nccl(dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.setattr(pd_nccl_transport, "CHUNK_BYTES", 16 << 20)  # several chunks per request
    producer, consumer = caches("cuda:0", dtype, True), caches("cuda:1", dtype, False)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    server = NcclBlockServer(producer, "127.0.0.1", port)
    puller = NcclBlockPuller(consumer, timeout_s=30.0)
    try:
        remote = torch.randperm(NUM_BLOCKS)[:512].tolist()  # 8192 tokens
        local = torch.randperm(NUM_BLOCKS)[:512].tolist()
        for i in range(3):  # the first pull makes the pair group (and NCCL's communicator)
            server.hold(f"p{i}", remote)
            start = time.perf_counter()
            puller.start(PullJob(f"d{i}", f"p{i}", address, remote, local))
            assert wait_for(puller) == ({f"d{i}"}, {})
            seconds = time.perf_counter() - start
        moved = sum(c[:, remote].numel() * c.element_size() for c in producer)
        print(f"\n{dtype}: {moved / 1e9:.2f} GB in {seconds * 1e3:.1f} ms = {moved / seconds / 1e9:.1f} GB/s")
        untouched = sorted(set(range(NUM_BLOCKS)) - set(local))
        for mine, theirs in zip(consumer, producer):
            assert torch.equal(mine[:, local].cpu(), theirs[:, remote].cpu())
            assert not mine[:, untouched].any()
        wait_for_release(server, {"p2"})
    finally:
        puller.close()
        server.close()


def test_a_refused_pull_fails_clearly_and_the_next_one_is_served() -> None:
    producer, consumer = caches("cuda:0", torch.bfloat16, True), caches("cuda:1", torch.bfloat16, False)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    server = NcclBlockServer(producer, "127.0.0.1", port)
    # (A pull of a request not held yet waits hold_grace_s, 10 s, for the hold to come.)
    puller = NcclBlockPuller(consumer, timeout_s=20.0)
    try:
        puller.start(PullJob("d0", "never-held", address, [1], [2]))
        done, failed = wait_for(puller)
        assert not done and "holds no KV" in failed["d0"]
        server.hold("p1", [3, 4])
        puller.start(PullJob("d1", "p1", address, [3, 4], [5, 6]))
        assert wait_for(puller) == ({"d1"}, {})
        for mine, theirs in zip(consumer, producer):
            assert torch.equal(mine[:, [5, 6]].cpu(), theirs[:, [3, 4]].cpu())
    finally:
        puller.close()
        server.close()
