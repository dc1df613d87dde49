"""The persistent batch: what the worker remembers about its requests, as numpy arrays.

Each live request owns a row. Its known tokens (prompt + outputs), its block table and its
sampling settings stay in that row across steps, and a SchedulerOutput only changes what moved:
new rows for new requests, appended block ids, one appended token per sampled request. A step's
inputs are then gathered for all scheduled rows at once with array indexing (no per-token
Python loops), and copied to the device in one transfer per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.protocol.messages import NewRequestData
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.worker.sampler import filtered_rows


@dataclass
class StepInputs:
    """One step's packed batch on the host; the model runner moves it to the device."""

    req_ids: list[str]  # scheduled requests, in batch order
    input_ids: np.ndarray  # [num_tokens]
    positions: np.ndarray  # [num_tokens]
    slot_mapping: np.ndarray  # [num_tokens]
    query_start_loc: np.ndarray  # [num_reqs + 1]
    seq_lens: np.ndarray  # [num_reqs]
    block_table: np.ndarray  # [num_reqs, num_block_columns]
    logits_indices: np.ndarray  # [num_sampling] token rows whose logits are sampled
    sampling_req_index: np.ndarray  # [num_sampling] their requests' places in req_ids
    sampling_rows: np.ndarray  # [num_sampling] their requests' persistent rows
    max_query_len: int
    max_seq_len: int
    # Input tokens not on the host yet (sampled by the previous step, still on the device): their
    # places in input_ids, and their places in that step's sampled ids.
    pending_token_index: np.ndarray | None = None
    pending_source: np.ndarray | None = None
    # Speculative decoding, only in a step that verifies drafts: per sampling request its number of
    # drafts k (it samples at its last k + 1 positions), and those positions' token rows, request
    # by request (logits_indices holds each request's last one, after its last draft).
    num_draft_tokens: np.ndarray | None = None
    spec_logits_indices: np.ndarray | None = None
    # A decode step that samples in a CUDA graph (worker/cuda_graphs.py): its rows' temperatures
    # and Philox seeds, which go to the device with its other inputs.
    sample_temperature: np.ndarray | None = None
    sample_seeds: np.ndarray | None = None
    # Set by the forward when it returned hidden states for the rows at logits_indices alone, in
    # that order (worker/output_rows.py).
    hidden_rows_sampled: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def sampling_req_ids(self) -> list[str]:
        """The ids of the requests that sample, in order (in a plain decode step, all of them)."""
        if len(self.sampling_req_index) == len(self.req_ids):
            return self.req_ids
        return [self.req_ids[i] for i in self.sampling_req_index.tolist()]


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.device = device

        # + 1: a prompt of max_model_len tokens still samples one token before it stops.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # known tokens per row
        # A row whose last token is still on the device (see append_pending): its place in the
        # previous step's sampled ids; -1 when all its tokens are on the host.
        self.pending = np.full(max_num_reqs, -1, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.generators: list[torch.Generator | None] = [None] * max_num_reqs
        self.seed = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: no seed of its own
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: no logprobs asked
        # Greedy or temperature alone: no top-k/top-p/min-p, logits processors or logprobs (a decode
        # step whose rows all sample plainly can sample in a CUDA graph).
        self.samples_plainly = np.zeros(max_num_reqs, dtype=bool)
        # Speculative decoding: rows that may get drafts (core/request.py Request.can_speculate).
        self.can_speculate = np.zeros(max_num_reqs, dtype=bool)
        # For worker/logits_processors.py: which rows need it, and what each asks for.
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.processes_logits = np.zeros(max_num_reqs, dtype=bool)
        self.penalized = np.zeros(max_num_reqs, dtype=bool)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_tokens_stop_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.logit_bias: list[dict[int, float]] = [{} for _ in range(max_num_reqs)]
        self.allowed_token_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.bad_words_token_ids: list[list[list[int]]] = [[] for _ in range(max_num_reqs)]
        # For worker/prompt_logprobs.py: top-k per row (-1: not asked), the requests still
        # prefilling that asked, and their scored chunks so far (ids, logprobs, ranks).
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.prompt_logprobs_reqs: set[str] = set()
        self.prompt_logprobs_chunks: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [
            [] for _ in range(max_num_reqs)]

        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        # rows_of's last answer (read-only), kept until a request comes or goes.
        self._last_ids: list[str] | None = None
        self._last_rows = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.row_of)

    # -- deltas from the scheduler ----------------------------------------------------------------

    def add_request(self, new: NewRequestData) -> None:
        if new.req_id in self.row_of:
            raise ValueError(f"request {new.req_id} is already in the batch")
        if not self.free_rows:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_reqs} requests in the batch")
        row = self.free_rows.pop()
        self.row_of[new.req_id] = row
        self._last_ids = None
        prompt = np.frombuffer(new.prompt_token_ids, dtype="<i4")
        num_tokens = len(prompt) + len(new.output_token_ids)
        self.token_ids[row, : len(prompt)] = prompt
        self.token_ids[row, len(prompt) : num_tokens] = new.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = len(prompt)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.pending[row] = -1
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        self._set_sampling(row, new.sampling_params, new.eos_token_ids)
        # A request resumed after a preemption with outputs already sent its prompt logprobs.
        asks = new.sampling_params.prompt_logprobs is not None and not new.output_token_ids
        self.num_prompt_logprobs[row] = new.sampling_params.prompt_logprobs if asks else -1
        self.prompt_logprobs_chunks[row] = []
        if asks:
            self.prompt_logprobs_reqs.add(new.req_id)

    def remove_request(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)  # ids never seen (aborted while waiting) are fine
        if row is not None:
            self._last_ids = None
            self.generators[row] = None
            self.pending[row] = -1
            self.prompt_logprobs_chunks[row] = []
            self.prompt_logprobs_reqs.discard(req_id)
            self.free_rows.append(row)

    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        """The rows of `req_ids`, in order (read-only). Decode steps ask for the same ids step
        after step, so the last answer is reused while no request came or went (a row changes
        hands only then): comparing the ids costs a fraction of looking each one up."""
        if req_ids != self._last_ids:
            rows = np.fromiter([self.row_of[r] for r in req_ids], dtype=np.int64, count=len(req_ids))
            rows.flags.writeable = False  # shared by the steps that reuse it
            self._last_ids, self._last_rows = list(req_ids), rows
        return self._last_rows

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(f"row {row}: {end} blocks exceed {self.max_blocks_per_req} (max_model_len)")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def _set_sampling(self, row: int, params: SamplingParams, eos_token_ids: list[int]) -> None:
        self.temperature[row] = params.temperature
        self.top_k[row] = max(params.top_k, 0)
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.seed[row] = -1 if params.seed is None else params.seed
        self.processes_logits[row] = params.processes_logits
        self.samples_plainly[row] = not (self.processes_logits[row] or self.num_logprobs[row] >= 0 or filtered_rows(
            self.temperature[row], self.top_k[row], self.top_p[row], self.min_p[row]))
        self.can_speculate[row] = (params.logprobs is None and params.prompt_logprobs is None
                                   and not params.processes_logits)
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.penalized[row] = (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
                               or params.repetition_penalty != 1.0)
        self.min_tokens[row] = params.min_tokens
        self.min_tokens_stop_ids[row] = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
        self.logit_bias[row] = dict(params.logit_bias or {})
        self.allowed_token_ids[row] = list(params.allowed_token_ids or [])
        self.bad_words_token_ids[row] = [list(word) for word in params._bad_words_token_ids or []]
        self.generators[row] = (
            None if params.seed is None else torch.Generator(device=self.device).manual_seed(params.seed)
        )

    # -- one step ----------------------------------------------------------------------------------

    def prepare(self, num_scheduled_tokens: dict[str, int],
                spec_decode_tokens: dict[str, list[int]] | None = None) -> StepInputs:
        """Gather the inputs of every scheduled request, vectorized over rows and tokens.
        spec_decode_tokens: drafts to verify, run after their requests' known tokens."""
        req_ids = list(num_scheduled_tokens)
        num_reqs = len(req_ids)
        rows = self.rows_of(req_ids)
        query_lens = np.fromiter(num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        max_query_len = int(query_lens.max())
        start = self.num_computed_tokens[rows]
        seq_lens = start + query_lens
        num_known = self.num_tokens[rows]
        known_end = num_known
        # Drafts sit in the rows past the known tokens (not counted by num_tokens until accepted).
        num_drafts = None
        if spec_decode_tokens:
            num_drafts = np.zeros(num_reqs, dtype=np.int64)
            for i, req_id in enumerate(req_ids):
                drafts = spec_decode_tokens.get(req_id)
                if drafts:
                    row, n = rows[i], self.num_tokens[rows[i]]
                    if n + len(drafts) > self.max_model_len:
                        raise ValueError(f"request {req_id}: drafts past max_model_len")
                    self.token_ids[row, n:n + len(drafts)] = drafts
                    num_drafts[i] = len(drafts)
            known_end = known_end + num_drafts
        # A request samples iff this step reaches the end of its known tokens (and drafts).
        samples = seq_lens == known_end
        every_request_samples = bool(samples.all())  # a plain decode step
        if not every_request_samples and np.any(seq_lens > known_end):
            bad = req_ids[int(np.argmax(seq_lens > known_end))]
            raise ValueError(f"request {bad}: scheduled past its known tokens")
        if num_drafts is not None and np.any((num_drafts > 0) & ~samples):
            raise ValueError("a request with drafts must run up to its last draft")

        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        # Token t of request i sits at position start[i] + (t - query_start_loc[i]): each request's
        # tokens are a run, so a token's indices are its request's plus t, one repeat per array (a
        # 16k-token chunk: ~6 passes over its tokens, where a gather of every per-request value for
        # every token took twice that).
        if max_query_len == 1 and num_tokens == num_reqs:  # decode only: token i is request i's
            positions = start
            token_id_index = rows * self.token_ids.shape[1] + positions
            block_index = rows * self.block_table.shape[1] + positions // self.block_size
        else:
            position_offset = np.repeat(start - query_start_loc[:-1], query_lens)
            positions = np.arange(num_tokens) + position_offset
            token_id_index = positions + np.repeat(rows * self.token_ids.shape[1], query_lens)
            block_index = positions // self.block_size + np.repeat(rows * self.block_table.shape[1], query_lens)
        input_ids = self.token_ids.reshape(-1).take(token_id_index)
        slot_mapping = self.block_table.reshape(-1).take(block_index).astype(np.int64)
        slot_mapping *= self.block_size
        slot_mapping += positions % self.block_size
        max_seq_len = int(seq_lens.max())
        num_columns = -(-max_seq_len // self.block_size)
        if np.any(self.num_blocks[rows] * self.block_size < seq_lens):
            raise ValueError("a scheduled request has fewer blocks than its tokens need")

        if every_request_samples:  # the same arrays as below, in fewer operations
            logits_indices, sampling_req_index, sampling_rows = query_start_loc[1:] - 1, np.arange(num_reqs), rows
        else:
            logits_indices = query_start_loc[1:][samples] - 1
            sampling_req_index, sampling_rows = np.flatnonzero(samples), rows[samples]
        spec_logits_indices = sampled_num_drafts = None
        if num_drafts is not None:
            sampled_num_drafts = num_drafts[samples]
            counts = sampled_num_drafts + 1
            first = query_start_loc[1:][samples] - counts
            offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            spec_logits_indices = np.repeat(first, counts) + offsets
        self.num_computed_tokens[rows] = seq_lens  # written by this step's forward
        # Tokens the previous step sampled and the host has not seen yet: only ever a row's last
        # known one, so at most one per request, found per request (in token order).
        row_pending = self.pending[rows]
        last_known = num_known - 1
        has_pending = (row_pending >= 0) & (start <= last_known) & (last_known < seq_lens)
        pending_token_index = (query_start_loc[:-1] + last_known - start)[has_pending]
        return StepInputs(
            req_ids=req_ids,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=self.block_table[rows, :num_columns],
            logits_indices=logits_indices,
            sampling_req_index=sampling_req_index,
            sampling_rows=sampling_rows,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            pending_token_index=pending_token_index,
            pending_source=row_pending[has_pending],
            num_draft_tokens=sampled_num_drafts,
            spec_logits_indices=spec_logits_indices,
        )

    def append_pending(self, rows: np.ndarray) -> None:
        """The step just launched samples a token for each of `rows` (in order); their values stay
        on the device until resolve_pending. The rows count them already, so the next step can be
        prepared (and its input ids taken from the device) before they arrive."""
        self.num_tokens[rows] += 1
        self.pending[rows] = np.arange(len(rows))

    def resolve_pending(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """The values of the tokens append_pending counted. Rows given to another request since
        (their pending mark was cleared) are skipped."""
        keep = self.pending[rows] >= 0
        if not keep.all():
            rows, token_ids = rows[keep], np.asarray(token_ids)[keep]
        self.token_ids[rows, self.num_tokens[rows] - 1] = token_ids
        self.pending[rows] = -1

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        """Several new known tokens of one row (accepted drafts and the token sampled after them)."""
        at = int(self.num_tokens[row])
        self.token_ids[row, at:at + len(token_ids)] = token_ids
        self.num_tokens[row] = at + len(token_ids)

    def append_sampled(self, rows: np.ndarray, token_ids: list[int]) -> None:
        """The sampled tokens become known tokens of their rows."""
        at = self.num_tokens[rows]
        self.token_ids[rows, at] = token_ids
        self.num_tokens[rows] = at + 1
