"""StepBuffers (worker/step_buffers.py): a step's inputs, packed into one buffer in one copy, land
where its layout's views read them, padded as a CUDA graph's bucket needs; the pending-input
arrays ride along. Runs on the CPU (the same code, unpinned, with no events)."""

from __future__ import annotations

import numpy as np
import torch

from minivllm.worker.input_batch import StepInputs
from minivllm.worker.step_buffers import StepBuffers, StepLayout

MAX_BLOCKS = 6


def step_of(query_lens: list[int], contexts: list[int], pending: tuple[list[int], list[int]] | None = None,
            sampling: bool = False) -> StepInputs:
    n = len(query_lens)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
    num_tokens = int(query_start_loc[-1])
    token_req = np.repeat(np.arange(n), query_lens)
    positions = np.arange(num_tokens) - query_start_loc[token_req] + np.asarray(contexts)[token_req]
    seq_lens = np.asarray(contexts) + np.asarray(query_lens)
    step = StepInputs(
        req_ids=[str(i) for i in range(n)], input_ids=np.arange(100, 100 + num_tokens), positions=positions,
        slot_mapping=np.arange(num_tokens) + 1000, query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_table=np.arange(n * 3, dtype=np.int32).reshape(n, 3) + 7, logits_indices=query_start_loc[1:] - 1,
        sampling_req_index=np.arange(n), sampling_rows=np.arange(n), max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        pending_token_index=None if pending is None else np.asarray(pending[0]),
        pending_source=None if pending is None else np.asarray(pending[1]))
    if sampling:
        step.sample_temperature = np.linspace(0.0, 1.0, n).astype(np.float32)
        step.sample_seeds = np.arange(n, dtype=np.int64) * 11
    return step


def test_layout_offsets_are_aligned_and_disjoint() -> None:
    for tokens, seqs in [(1, 1), (3, 3), (64, 9), (8192, 257), (7, 2)]:
        fields = StepLayout(tokens, seqs).fields
        spans = sorted((offset, offset + count * dtype.itemsize) for offset, count, dtype in fields.values())
        assert all(offset % 8 == 0 for offset, _ in spans)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        assert StepLayout(tokens, seqs).nbytes >= spans[-1][1]


def test_an_eager_step_lands_unpadded() -> None:
    buffers = StepBuffers(64, 4, MAX_BLOCKS, torch.device("cpu"))
    step = step_of([3, 1, 2], [0, 5, 9], pending=([3], [0]))
    metadata = buffers.load(step)
    input_ids, positions = buffers.forward_inputs
    assert input_ids.tolist() == step.input_ids.tolist() and positions.tolist() == step.positions.tolist()
    assert metadata.slot_mapping.tolist() == step.slot_mapping.tolist()
    assert metadata.query_start_loc.tolist() == step.query_start_loc.tolist()
    assert metadata.seq_lens.tolist() == step.seq_lens.tolist()
    assert metadata.num_active_seqs.tolist() == [3]
    assert metadata.block_tables[:, :3].tolist() == step.block_table.tolist()
    assert buffers.pending_index.tolist() == [3] and buffers.pending_source.tolist() == [0]


def test_a_decode_step_padded_to_its_bucket_gives_each_padding_row_a_sequence() -> None:
    buffers = StepBuffers(64, 8, MAX_BLOCKS, torch.device("cpu"))
    step = step_of([1, 1, 1], [4, 8, 2], pending=([0, 2], [1, 0]), sampling=True)
    metadata = buffers.load(step, padded_tokens=4, padded_seqs=4)
    input_ids, positions = buffers.forward_inputs
    assert input_ids.tolist() == [100, 101, 102, 0] and positions.tolist() == [4, 8, 2, 0]
    assert metadata.slot_mapping.tolist() == [1000, 1001, 1002, -1]
    assert metadata.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert metadata.seq_lens.tolist() == [5, 9, 3, 0]
    assert metadata.num_active_seqs.tolist() == [4]
    views = buffers.views(4, 4)
    assert views.temperature[:3].tolist() == [0.0, 0.5, 1.0] and views.sample_seeds[:3].tolist() == [0, 11, 22]
    assert buffers.pending_index.tolist() == [0, 2] and buffers.pending_source.tolist() == [1, 0]
    # the attention's order, longest first (padding last), sorted on the host: no sort on the device
    assert metadata.seq_order.tolist() == [1, 0, 2, 3] and metadata.longest_first() is metadata.seq_order
    step = step_of([1, 1, 1, 1], [6, 2, 6, 9])  # ties keep their order
    assert buffers.load(step).longest_first().tolist() == [3, 0, 2, 1]


def test_a_mixed_step_puts_its_padding_tokens_in_one_sequence_after_its_own() -> None:
    buffers = StepBuffers(64, 4, MAX_BLOCKS, torch.device("cpu"))
    step = step_of([5, 1], [0, 3])
    metadata = buffers.load(step, padded_tokens=16, padded_seqs=5)
    assert metadata.query_start_loc.tolist() == [0, 5, 6, 16, 16, 16]
    assert metadata.seq_lens.tolist() == [5, 4, 0, 0, 0]
    assert metadata.num_active_seqs.tolist() == [3]
    assert metadata.slot_mapping.tolist() == list(range(1000, 1006)) + [-1] * 10
    assert len(buffers.pending_index) == 0
    assert metadata.seq_order is None  # (a mixed step's attention takes its sequences as they come)


def test_loads_of_different_layouts_in_turn_each_read_what_they_wrote() -> None:
    """Layouts of different sizes overlap in the buffer (a graph's replay always follows its own
    load); around the ring of host buffers, every load's views read back what it wrote."""
    buffers = StepBuffers(64, 8, MAX_BLOCKS, torch.device("cpu"))
    for i in range(5):
        buffers.load(step_of([1, 1], [3 + i, 4]), padded_tokens=2, padded_seqs=2)
        assert buffers.views(2, 2).positions.tolist() == [3 + i, 4]
        buffers.load(step_of([2, 1, 1], [i, 1, 2]))
        assert buffers.forward_inputs[1].tolist() == [i, i + 1, 1, 2]


def test_a_capture_layout_is_padding_only_whatever_a_load_left_there() -> None:
    """A CUDA graph is captured on a layout of padding; a larger step loaded before has written its
    own arrays over that layout's bytes, and every array the capture's kernels index by must be
    valid again (token ids, positions, the decode order: out of range, the capture reads outside
    its tables)."""
    buffers = StepBuffers(64, 8, MAX_BLOCKS, torch.device("cpu"))
    buffers.load(step_of([40, 20], [0, 0]))  # token ids 100..159 over the small layouts
    views = buffers.fill_padding(4, 4)
    metadata = buffers.metadata(4, 4, max_query_len=1, max_seq_len=16)
    assert views.input_ids.tolist() == [0] * 4 and views.positions.tolist() == [0] * 4
    assert metadata.slot_mapping.tolist() == [-1] * 4 and metadata.seq_lens.tolist() == [0] * 4
    assert metadata.query_start_loc.tolist() == [0, 1, 2, 3, 4] and metadata.num_active_seqs.tolist() == [4]
    assert sorted(metadata.longest_first().tolist()) == [0, 1, 2, 3]


def test_long_prefill_steps_tma_share_is_computed_once(monkeypatch) -> None:
    """Where the Hopper prefill kernel serves, a long prefill step's TMA share (hopper_prefill.tma_share) is
    computed once (the graphs' bucket asks, then the eager step's metadata), and the step is taken
    by that kernel as hopper_prefill.takes_step says; elsewhere nothing is computed."""
    from minivllm.worker.attention import hopper_prefill
    from minivllm.worker.attention.kv_cache import KVCacheLayout

    step = step_of([2048], [8000])
    columns = 700
    step.block_table = np.arange(columns, dtype=np.int32).reshape(1, columns)  # consecutive blocks
    buffers = StepBuffers(4096, 2, columns, torch.device("cpu"))
    buffers.kv_layout = KVCacheLayout(16, 2, 128, torch.bfloat16)
    calls = []
    real = hopper_prefill.takes_step
    monkeypatch.setattr(hopper_prefill, "takes_step", lambda *a: calls.append(1) or real(*a))

    assert not buffers.takes_hopper_prefill(step)  # the kernel does not serve: nothing looked at
    assert buffers.load(step).tma_share is None and not calls

    buffers.hopper_prefill = True
    assert buffers.takes_hopper_prefill(step)
    assert buffers.load(step).tma_share == 1.0
    assert len(calls) == 1
    assert real(step.num_tokens, step.max_seq_len, step.block_table, step.seq_lens, 16) == (True, 1.0)

    scattered = step_of([2048], [8000])
    scattered.block_table = np.random.default_rng(0).permutation(columns).astype(np.int32).reshape(1, columns)
    assert not buffers.takes_hopper_prefill(scattered)
    assert buffers.load(scattered).tma_share == 0.0
    short = step_of([100], [100])
    assert not buffers.takes_hopper_prefill(short) and buffers.load(short).tma_share is None
    assert len(calls) == 3
