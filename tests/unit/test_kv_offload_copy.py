"""The CPU offload tier's worker side on CPU: blocks copied out to host blocks and back land
where the metadata says, in every layer, K and V (one gather over the layer caches, which are views
of one tensor as the model runner allocates them); caches allocated apart are refused."""

from __future__ import annotations

import random

import pytest
import torch

from minivllm.protocol.kv_transfer import BlockCopy
from minivllm.worker.attention.kv_cache import KVCacheLayout
from minivllm.worker.kv_connector.offloading import STAGING_BLOCKS, OffloadingConnectorWorker
from tests.unit.scheduler_harness import make_config

NUM_LAYERS, NUM_GPU_BLOCKS = 3, 2 * STAGING_BLOCKS + 5


def test_allocate_layers_gives_views_of_one_tensor() -> None:
    layout = KVCacheLayout(block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    caches = layout.allocate_layers(NUM_LAYERS, 7, torch.device("cpu"))
    assert [c.shape for c in caches] == [layout.shape(7)] * NUM_LAYERS
    assert all(c.is_contiguous() and not c.any() for c in caches)
    caches[1][0, 3].fill_(1.0)  # one layer's block, nothing else
    assert caches[1].sum() == caches[1][0, 3].numel() and not caches[0].any() and not caches[2].any()


def make_worker(num_host_blocks: int, caches: list[torch.Tensor]) -> OffloadingConnectorWorker:
    block_bytes = len(caches) * caches[0][:, 0].numel() * caches[0].element_size()
    config = make_config(dtype="float32", kv_offloading_size=num_host_blocks * block_bytes / (1 << 30))
    worker = OffloadingConnectorWorker(config, rank=0, device=torch.device("cpu"))
    worker.register_kv_caches(caches)
    return worker


def test_layer_caches_allocated_apart_are_refused() -> None:
    layout = KVCacheLayout(block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    caches = [layout.allocate(NUM_GPU_BLOCKS, torch.device("cpu")) for _ in range(NUM_LAYERS)]
    with pytest.raises(ValueError, match="views of one tensor"):
        make_worker(8, caches)


@pytest.mark.parametrize("num_layers", [NUM_LAYERS, 1])
@pytest.mark.parametrize("fp8", [False, True])
def test_blocks_go_to_host_and_come_back_in_place(num_layers: int, fp8: bool) -> None:
    layout = KVCacheLayout(block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, fp8=fp8)
    caches = layout.allocate_layers(num_layers, NUM_GPU_BLOCKS, torch.device("cpu"))
    for cache in caches:  # every byte different (uint8 for fp8: random bytes)
        cache.copy_(torch.randint(0, 256, cache.shape) if fp8 else torch.randn(cache.shape))
    original = [cache.clone() for cache in caches]
    num_host_blocks = 64
    worker = make_worker(num_host_blocks, caches)
    assert worker.host_blocks.shape[0] == num_host_blocks

    rng = random.Random(0)
    # More blocks than one staging pass, in runs of consecutive host slots and not.
    gpu_ids = rng.sample(range(NUM_GPU_BLOCKS), STAGING_BLOCKS + 7)
    host_ids = list(range(10, 10 + 12)) + rng.sample(range(30, 64), len(gpu_ids) - 12)
    worker._copy(BlockCopy(gpu_ids, host_ids), to_host=True)
    for gpu_id, host_id in zip(gpu_ids, host_ids):
        for layer in range(num_layers):
            assert torch.equal(worker.host_blocks[host_id, layer], original[layer][:, gpu_id])

    # Back into other GPU blocks; the rest of the cache is untouched.
    targets = rng.sample(range(NUM_GPU_BLOCKS), len(gpu_ids))
    worker._copy(BlockCopy(targets, host_ids), to_host=False)
    for layer in range(num_layers):
        for block in range(NUM_GPU_BLOCKS):
            if block in targets:
                source = gpu_ids[targets.index(block)]
                assert torch.equal(caches[layer][:, block], original[layer][:, source]), (layer, block)
            else:
                assert torch.equal(caches[layer][:, block], original[layer][:, block]), (layer, block)
