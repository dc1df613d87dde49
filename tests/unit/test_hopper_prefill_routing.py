"""Which prefill steps the Hopper kernel takes (worker/attention/hopper_prefill.py): decided on
the host from a step's sizes and block table, so it is checked here without a GPU."""

from __future__ import annotations

import re

import numpy as np
from minivllm.worker.attention import hopper_prefill as hp

LONG = hp.MIN_SEQ_LEN


def test_tma_share_counts_whole_tiles_of_long_sequences() -> None:
    block_size = 16  # 8 blocks a 128-key tile
    tiles = LONG // 128
    consecutive = np.arange(tiles * 8)
    scattered = np.random.default_rng(0).permutation(tiles * 8)
    half = consecutive.copy()
    half[: tiles * 4] = scattered[: tiles * 4] + 10**6  # the first half of the tiles broken up
    table = np.zeros((4, tiles * 8 + 3), dtype=np.int32)
    table[0, : tiles * 8] = consecutive
    assert hp.tma_share(table[:1], np.array([LONG]), block_size) == 1.0
    table[1, : tiles * 8] = scattered
    assert hp.tma_share(table[1:2], np.array([LONG]), block_size) < 0.01
    table[2, : tiles * 8] = half
    assert hp.tma_share(table[2:3], np.array([LONG]), block_size) == 0.5
    # Short sequences don't count (rows 2 and 3 here); a partial last tile doesn't either (row 0's 100).
    lengths = np.array([LONG + 100, LONG, LONG - 1, 50])
    share = hp.tma_share(table, lengths, block_size)
    scattered_hits = int((np.diff(np.sort(scattered.reshape(tiles, 8), axis=1), axis=1) == 1).all(axis=1).sum())
    assert share == (tiles + scattered_hits) / (2 * tiles)
    assert hp.tma_share(table, np.array([LONG - 1] * 4), block_size) == 0.0  # no long sequence


def test_runs_of_consecutive_ids_count_in_any_order() -> None:
    """A freed request's blocks come back last first: a tile of descending ids is one 128-row box
    too (the kernel copies it so wherever the causal mask leaves the tile whole), and so is a
    shuffled run. A run with a gap or a repeated id is not."""
    tiles = LONG // 128
    descending = np.arange(tiles * 8)[::-1].reshape(1, -1).copy()
    assert hp.tma_share(descending, np.array([LONG]), 16) == 1.0
    rng = np.random.default_rng(2)
    shuffled = np.concatenate([8 * t + rng.permutation(8) for t in range(tiles)]).reshape(1, -1)
    assert hp.tma_share(shuffled, np.array([LONG]), 16) == 1.0
    gaps = shuffled.copy()
    gaps[0, 0:8] = [0, 1, 2, 3, 4, 5, 6, 8]  # 7 missing
    gaps[0, 8:16] = [9, 9, 10, 11, 12, 13, 14, 15]  # 9 twice
    assert hp.tma_share(gaps, np.array([LONG]), 16) == (tiles - 2) / tiles


def test_blocks_of_box_size_always_go_by_tma() -> None:
    """Blocks of a whole tile are one box; blocks of BLOCK_BOX_MIN_SLOTS or more are a box each, in
    any order. A step with no long sequence has no tiles to count."""
    for block_size in (hp.BLOCK_BOX_MIN_SLOTS, 128):
        blocks = LONG // block_size
        table = np.random.default_rng(block_size).permutation(blocks * 50)[:blocks].reshape(1, -1)
        assert hp.tma_share(table, np.array([LONG]), block_size) == 1.0
        assert hp.tma_share(table, np.array([LONG - 1]), block_size) == 0.0
    assert hp.tma_share(np.random.default_rng(3).permutation(LONG // 32 * 50)[: LONG // 32].reshape(1, -1),
                        np.array([LONG]), 32) < 0.01  # 32 slots: gathered


def test_box_threshold_is_the_kernels() -> None:
    """The routing's BLOCK_BOX_MIN_SLOTS is the kernel's kBlockBoxMinSlots."""
    with open(hp.SOURCE) as f:
        found = re.search(r"constexpr int kBlockBoxMinSlots = (\d+);", f.read())
    assert found is not None and int(found.group(1)) == hp.BLOCK_BOX_MIN_SLOTS


def test_takes_big_steps_with_a_long_sequence_in_consecutive_enough_blocks() -> None:
    assert hp.takes(hp.MIN_TOKENS, LONG)
    assert hp.takes(hp.MIN_TOKENS, LONG, share=hp.MIN_TMA_SHARE)
    assert not hp.takes(hp.MIN_TOKENS, LONG, share=hp.MIN_TMA_SHARE / 2)
    assert not hp.takes(hp.MIN_TOKENS - 1, LONG)
    assert not hp.takes(hp.MIN_TOKENS, LONG - 1)
    tiles = LONG // 128
    table = np.arange(tiles * 8).reshape(1, -1)
    assert hp.takes_step(hp.MIN_TOKENS, LONG, table, np.array([LONG]), 16) == (True, 1.0)
    assert hp.takes_step(hp.MIN_TOKENS, LONG, table[:, ::-1].copy(), np.array([LONG]), 16) == (True, 1.0)
    scattered = np.random.default_rng(3).permutation(tiles * 8).reshape(1, -1)
    taken, share = hp.takes_step(hp.MIN_TOKENS, LONG, scattered, np.array([LONG]), 16)
    assert not taken and share < hp.MIN_TMA_SHARE
    # A step it could never take computes nothing.
    assert hp.takes_step(hp.MIN_TOKENS - 1, LONG, table, np.array([LONG]), 16) == (False, None)


def test_a_call_with_the_wrong_metadata_types_is_refused_before_the_kernel() -> None:
    """The kernel reads int32 tables through raw pointers: anything else is refused with its name
    (checked before the library is touched, so on the CPU too)."""
    import pytest
    import torch

    from minivllm.worker.attention.kv_cache import KVCacheLayout
    from minivllm.worker.attention.metadata import AttentionMetadata

    layout = KVCacheLayout(16, 2, 128, torch.bfloat16)
    cache = layout.allocate(4, torch.device("cpu"))
    query = torch.zeros(20, 4, 128, dtype=torch.bfloat16)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 20], dtype=torch.int32), seq_lens=torch.tensor([20], dtype=torch.int32),
        block_tables=torch.zeros(1, 4, dtype=torch.int64), slot_mapping=torch.arange(20),
        max_query_len=20, max_seq_len=20)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        hp.prefill_attention(query, cache, layout, metadata, 1.0, torch.empty_like(query))
    with pytest.raises(ValueError, match="out must be"):
        hp.prefill_attention(query, cache, layout, metadata, 1.0, torch.empty(20, 4, 128))
