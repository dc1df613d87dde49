"""A step's inputs on the device, in one host-to-device copy.

Every step's small arrays (input ids, positions, slot mapping, query_start_loc / seq_lens, the
sampling graph's temperatures and seeds, the places of input ids still on the device) are written
into one pinned host buffer, packed one after the other, and copied in one cudaMemcpyAsync into
one device buffer; the block table follows in a second copy. (Before, a batch-1 decode step made
ten small copies, each from pageable memory, which the driver stages through a buffer of its own.)

Where an array lands depends on the step's token and sequence counts (StepLayout): a CUDA graph
reads its bucket's arrays at its bucket's offsets, baked in at capture, and an eager step uses its
own counts. The pinned buffer is a ring of a few: a copy is asynchronous, so a buffer is written
again only once the copy that read it has run (its event; by then long done in practice).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from minivllm.worker.attention import hopper_prefill
from minivllm.worker.attention.kv_cache import KVCacheLayout
from minivllm.worker.attention.metadata import AttentionMetadata, step_splits_decodes
from minivllm.worker.input_batch import StepInputs

_RING = 3  # pinned host buffers in turn (a step's copy may still be queued when the next is written)


def _aligned(offset: int) -> int:
    return -(-offset // 8) * 8


class StepLayout(NamedTuple):
    """Byte offsets of a step's arrays in the packed buffer, for T tokens and S sequences."""

    tokens: int
    seqs: int

    @property
    def fields(self) -> dict[str, tuple[int, int, np.dtype]]:
        """name -> (byte offset, element count, dtype). seq_info is query_start_loc [S + 1], then
        seq_lens [S], then the count of sequences with tokens [1], then (decode steps) the sequences
        by decreasing length [S] (see StepBuffers.load)."""
        return _fields(self.tokens, self.seqs)

    @property
    def nbytes(self) -> int:
        """Where the fixed arrays end: the pending-input arrays (variable length) follow."""
        offset, count, dtype = _fields(self.tokens, self.seqs)["temperature"]
        return _aligned(offset + count * dtype.itemsize)


@functools.cache
def _fields(tokens: int, seqs: int) -> dict[str, tuple[int, int, np.dtype]]:
    fields, offset = {}, 0
    for name, count, dtype in (("input_ids", tokens, np.int64), ("positions", tokens, np.int64),
                               ("slot_mapping", tokens, np.int64), ("sample_seeds", seqs, np.int64),
                               ("seq_info", 3 * seqs + 2, np.int32), ("temperature", seqs, np.float32)):
        fields[name] = (offset, count, np.dtype(dtype))
        offset = _aligned(offset + count * np.dtype(dtype).itemsize)
    return fields


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32}


class StepViews(NamedTuple):
    """A layout's arrays as views of the device buffer (what a graph or a forward reads)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_active_seqs: torch.Tensor
    seq_order: torch.Tensor
    sample_seeds: torch.Tensor
    temperature: torch.Tensor


class StepBuffers:
    """Persistent device tensors a step's inputs are copied into (graphs read them by address)."""

    def __init__(self, max_tokens: int, max_num_seqs: int, max_blocks_per_req: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.max_seqs = max_num_seqs + 1  # + the sequence that holds a mixed graph's padding tokens
        self.device = device
        largest = StepLayout(max_tokens, self.max_seqs).nbytes + 2 * 8 * max_tokens  # + pending index, source
        self.packed = torch.zeros(largest, dtype=torch.uint8, device=device)
        self.block_tables = torch.zeros(self.max_seqs, max_blocks_per_req, dtype=torch.int32, device=device)
        self.kv_layout: KVCacheLayout | None = None  # set by the model runner; told to the backends
        # Set by the model runner where the Hopper prefill kernel serves the model
        # (hopper_prefill.serves): then a long prefill step's block layout is looked at.
        self.hopper_prefill = False
        self._routing_of: tuple[StepInputs | None, tuple[bool, float | None]] = (None, (False, None))
        # A sampling graph's rows (row i of a decode step is its sequence i) and its output.
        self.sample_rows = torch.arange(self.max_seqs, device=device)
        self.sampled = torch.zeros(self.max_seqs, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        host_bytes = largest + self.block_tables.numel() * 4
        self._host = [torch.empty(host_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(_RING)]
        self._host_np = [h.numpy() for h in self._host]
        self._copied: list[torch.cuda.Event | None] = [None] * _RING
        self._turn = 0
        # What the last load put on the device: the forward's inputs and the places of the input
        # ids that come from the previous step's sampled ids (and their places there).
        self.forward_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pending_index: torch.Tensor | None = None
        self.pending_source: torch.Tensor | None = None

    @functools.lru_cache(maxsize=128)  # a graph's bucket sizes, and the last eager steps' counts
    def views(self, tokens: int, seqs: int) -> StepViews:
        def view(name: str) -> torch.Tensor:
            offset, count, dtype = StepLayout(tokens, seqs).fields[name]
            return self.packed[offset: offset + count * dtype.itemsize].view(_TORCH_DTYPES[dtype])

        seq_info = view("seq_info")
        return StepViews(view("input_ids"), view("positions"), view("slot_mapping"), seq_info[: seqs + 1],
                         seq_info[seqs + 1: 2 * seqs + 1], seq_info[2 * seqs + 1: 2 * seqs + 2],
                         seq_info[2 * seqs + 2:], view("sample_seeds"), view("temperature"))

    def fill_padding(self, tokens: int, seqs: int) -> StepViews:
        """Set a layout's every array on the device to a step of padding only (what a CUDA graph is
        captured on): no cache slot written, every sequence empty. Layouts of other sizes overlap
        this one, so whatever a load left here may be other arrays' bytes, and several arrays
        index others (token ids the embedding, positions RoPE's tables, seq_order the sequences)."""
        views = self.views(tokens, seqs)
        views.input_ids.zero_()
        views.positions.zero_()
        views.slot_mapping.fill_(-1)
        views.seq_lens.zero_()
        views.query_start_loc.copy_(torch.linspace(0, tokens, seqs + 1, device=self.device).int())
        views.num_active_seqs.fill_(seqs)
        views.seq_order.copy_(torch.arange(seqs, dtype=torch.int32))
        return views

    @functools.lru_cache(maxsize=_RING * 64)
    def _host_arrays(self, turn: int, tokens: int, seqs: int) -> dict[str, np.ndarray]:
        """A layout's arrays in host buffer `turn`, as numpy views to write into."""
        host_np = self._host_np[turn]
        return {name: host_np[offset: offset + count * dtype.itemsize].view(dtype)
                for name, (offset, count, dtype) in StepLayout(tokens, seqs).fields.items()}

    @functools.lru_cache(maxsize=_RING * 64)
    def _table_views(self, turn: int, rows: int, columns: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """A rows x columns block table's place in host buffer `turn` (after the packed arrays), as a
        numpy view to write into and as the host tensor its copy reads, and where the copy lands."""
        offset, nbytes = self.packed.numel(), rows * columns * 4
        host_np = self._host_np[turn][offset: offset + nbytes].view(np.int32).reshape(rows, columns)
        host = self._host[turn][offset: offset + nbytes].view(torch.int32).view(rows, columns)
        return host_np, host, self.block_tables[:rows, :columns]

    @functools.lru_cache(maxsize=128)
    def _pending_views(self, offset: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The places of `count` input ids still on the device and their places in the previous
        step's sampled ids, as the packed copy puts them at byte `offset` of the device buffer."""
        pending = self.packed[offset: offset + 16 * count].view(torch.int64)
        return pending[:count], pending[count:]

    def load(self, step: StepInputs, padded_tokens: int | None = None,
             padded_seqs: int | None = None) -> AttentionMetadata:
        """Copy a step's host arrays in, padded (on the host) to a graph's bucket when given."""
        num_seqs, num_tokens = len(step.req_ids), step.num_tokens
        tokens = padded_tokens if padded_tokens is not None else num_tokens
        seqs = padded_seqs if padded_seqs is not None else num_seqs
        layout = StepLayout(tokens, seqs)
        turn = self._turn
        self._turn = (turn + 1) % _RING
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # the copy that last read this buffer has run
        host, host_np = self._host[turn], self._host_np[turn]
        arrays = self._host_arrays(turn, tokens, seqs)
        # Padding tokens: position 0 and slot -1 (nothing written to the cache).
        for name, array, pad in (("input_ids", step.input_ids, 0), ("positions", step.positions, 0),
                                 ("slot_mapping", step.slot_mapping, -1)):
            out = arrays[name]
            out[:num_tokens] = array
            out[num_tokens:] = pad
        seq_info = arrays["seq_info"]
        seq_info[:] = 0  # padding sequences: length 0
        seq_info[seqs + 1: seqs + 1 + num_seqs] = step.seq_lens
        num_active = num_seqs
        if padded_tokens is None:
            seq_info[: num_seqs + 1] = step.query_start_loc
        elif step.max_query_len == 1:  # decode: a token per sequence, padding ones included
            seq_info[: seqs + 1] = np.arange(seqs + 1)
            num_active = seqs
        else:  # one sequence holding every padding token, then empty ones
            seq_info[: num_seqs + 1] = step.query_start_loc
            seq_info[num_seqs + 1: seqs + 1] = tokens
            num_active = num_seqs + 1
        seq_info[2 * seqs + 1] = num_active
        if step.max_query_len == 1:  # a decode step's order for its attention (padding rows, length 0, last)
            seq_info[2 * seqs + 2:] = np.argsort(-seq_info[seqs + 1: 2 * seqs + 1], kind="stable")
        if step.sample_temperature is not None:  # padding rows: greedy (nobody reads their tokens)
            num_rows = len(step.sample_temperature)
            temperature, seeds = arrays["temperature"], arrays["sample_seeds"]
            temperature[:num_rows] = step.sample_temperature
            temperature[num_rows:] = 0.0
            seeds[:num_rows] = step.sample_seeds
            seeds[num_rows:] = 0
        nbytes = layout.nbytes
        num_pending = 0 if step.pending_token_index is None else len(step.pending_token_index)
        if num_pending:
            pending = host_np[nbytes: nbytes + 16 * num_pending].view(np.int64)
            pending[:num_pending] = step.pending_token_index
            pending[num_pending:] = step.pending_source
        self.packed[: nbytes + 16 * num_pending].copy_(host[: nbytes + 16 * num_pending], non_blocking=True)
        table, host_table, device_table = self._table_views(turn, *step.block_table.shape)
        table[:] = step.block_table
        device_table.copy_(host_table, non_blocking=True)
        if self.device.type == "cuda":
            if self._copied[turn] is None:
                self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()

        views = self.views(tokens, seqs)
        self.forward_inputs = (views.input_ids, views.positions)
        self.pending_index, self.pending_source = self._pending_views(nbytes, num_pending)
        # (A graph's bucket says for itself; an eager step as a graph of its size would.)
        metadata = self.metadata(tokens, seqs, step.max_query_len, step.max_seq_len,
                                 step_splits_decodes(num_seqs, num_tokens, step.max_query_len))
        metadata.tma_share = self.tma_share(step)
        return metadata

    def _hopper_routing(self, step: StepInputs) -> tuple[bool, float | None]:
        """hopper_prefill.takes_step for the step where that kernel serves the model ((False, None)
        elsewhere), computed once per step: the graphs' bucket and an eager step's metadata both ask."""
        if not self.hopper_prefill:
            return False, None
        if self._routing_of[0] is not step:
            self._routing_of = (step, hopper_prefill.takes_step(step.num_tokens, step.max_seq_len, step.block_table,
                                                                step.seq_lens, self.kv_layout.block_size))
        return self._routing_of[1]

    def tma_share(self, step: StepInputs) -> float | None:
        """The step's hopper_prefill.tma_share where that kernel serves the model and the step is one
        it could take (None otherwise)."""
        return self._hopper_routing(step)[1]

    def takes_hopper_prefill(self, step: StepInputs) -> bool:
        """Whether the step's attention goes to the Hopper prefill kernel (StepGraphs' eager_prefill)."""
        return self._hopper_routing(step)[0]

    def metadata(self, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int,
                 split_decodes: bool = True) -> AttentionMetadata:
        views = self.views(num_tokens, num_seqs)
        return AttentionMetadata(
            query_start_loc=views.query_start_loc,
            seq_lens=views.seq_lens,
            block_tables=self.block_tables[:num_seqs],
            slot_mapping=views.slot_mapping,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            kv_layout=self.kv_layout,
            num_active_seqs=views.num_active_seqs,
            split_decodes=split_decodes,
            seq_order=views.seq_order if max_query_len == 1 else None,
        )
