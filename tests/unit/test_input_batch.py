"""InputBatch.prepare (worker/input_batch.py) gathers a step's inputs with array operations, with a
shorter way for decode-only steps and rows looked up once while the running requests stay the
same: on random sequences of steps (prefill chunks, decodes, requests leaving and rows reused,
tokens held back on the device) it must give what a plain loop over requests and tokens gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.protocol.messages import NewRequestData
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.worker.input_batch import InputBatch, StepInputs
from minivllm.worker.sampler import filtered_rows

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
MAX_REQS = 6


def reference_step(batch: InputBatch, num_scheduled_tokens: dict[str, int]) -> dict[str, np.ndarray | int]:
    """What prepare should return, request by request and token by token (read before it runs:
    prepare advances num_computed_tokens)."""
    input_ids, positions, slots, query_start_loc, seq_lens, rows = [], [], [], [0], [], []
    logits_indices, sampling_req_index, pending_index, pending_source = [], [], [], []
    for i, (req_id, query_len) in enumerate(num_scheduled_tokens.items()):
        row = batch.row_of[req_id]
        start, known = int(batch.num_computed_tokens[row]), int(batch.num_tokens[row])
        for position in range(start, start + query_len):
            if batch.pending[row] >= 0 and position == known - 1:
                pending_index.append(len(input_ids))
                pending_source.append(int(batch.pending[row]))
            input_ids.append(int(batch.token_ids[row, position]))
            positions.append(position)
            slots.append(int(batch.block_table[row, position // BLOCK_SIZE]) * BLOCK_SIZE + position % BLOCK_SIZE)
        query_start_loc.append(len(input_ids))
        seq_lens.append(start + query_len)
        rows.append(row)
        if start + query_len == known:
            logits_indices.append(len(input_ids) - 1)
            sampling_req_index.append(i)
    num_columns = -(-max(seq_lens) // BLOCK_SIZE)
    return dict(input_ids=input_ids, positions=positions, slot_mapping=slots, query_start_loc=query_start_loc,
                seq_lens=seq_lens, block_table=batch.block_table[rows, :num_columns].copy(),
                logits_indices=logits_indices, sampling_req_index=sampling_req_index,
                sampling_rows=[rows[i] for i in sampling_req_index], pending_token_index=pending_index,
                pending_source=pending_source, max_query_len=max(num_scheduled_tokens.values()),
                max_seq_len=max(seq_lens))


def assert_step_equals(step: StepInputs, expected: dict[str, np.ndarray | int], req_ids: list[str]) -> None:
    assert step.req_ids == req_ids
    assert step.sampling_req_ids() == [req_ids[i] for i in expected["sampling_req_index"]]
    for name, value in expected.items():
        actual = getattr(step, name)
        if isinstance(value, int):
            assert actual == value, name
        else:
            assert actual.dtype.kind == "i", name
            np.testing.assert_array_equal(actual, np.asarray(value).reshape(actual.shape), err_msg=name)


@pytest.mark.parametrize("seed", range(8))
def test_prepare_equals_a_loop_over_requests_and_tokens(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = InputBatch(MAX_REQS, MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu"))
    live: list[str] = []
    next_id = 0
    for _ in range(60):
        # Now and then a request leaves (its row goes to the next one) or a new one comes.
        if live and rng.random() < 0.15:
            gone = live.pop(int(rng.integers(len(live))))
            batch.remove_request(gone)
        if len(live) < MAX_REQS and (not live or rng.random() < 0.3):
            prompt = rng.integers(1, 100, int(rng.integers(1, 20))).tolist()
            blocks = rng.choice(1000, -(-MAX_MODEL_LEN // BLOCK_SIZE), replace=False).tolist()
            req_id = f"r{next_id}"
            next_id += 1
            batch.add_request(NewRequestData(req_id=req_id, prompt_token_ids=prompt, output_token_ids=[],
                                             sampling_params=SamplingParams(), block_ids=blocks,
                                             num_computed_tokens=0))
            live.append(req_id)
        for req_id in [r for r in live if batch.num_tokens[batch.row_of[r]] == MAX_MODEL_LEN]:
            live.remove(req_id)  # finished
            batch.remove_request(req_id)
        if not live:
            continue
        # Each request runs a chunk of the tokens it has not run (a decode: its last one).
        num_scheduled_tokens = {}
        for req_id in live:
            row = batch.row_of[req_id]
            left = int(batch.num_tokens[row] - batch.num_computed_tokens[row])
            num_scheduled_tokens[req_id] = int(rng.integers(1, left + 1))
        req_ids = list(num_scheduled_tokens)
        expected = reference_step(batch, num_scheduled_tokens)
        step = batch.prepare(num_scheduled_tokens)
        assert_step_equals(step, expected, req_ids)
        # The sampled tokens: known at once, or held back on the device (and resolved now or at once).
        sampled = rng.integers(100, 200, len(step.sampling_rows))
        if not len(sampled):
            continue
        if rng.random() < 0.5:
            batch.append_sampled(step.sampling_rows, sampled.tolist())
        else:
            batch.append_pending(step.sampling_rows)
            if rng.random() < 0.5:
                batch.resolve_pending(step.sampling_rows, sampled)
            else:  # the next step runs first: its input ids for them come from the device
                num_scheduled = dict.fromkeys(step.sampling_req_ids(), 1)
                pending_step = batch.prepare(num_scheduled)
                np.testing.assert_array_equal(pending_step.pending_token_index, np.arange(len(num_scheduled)))
                np.testing.assert_array_equal(pending_step.pending_source, np.arange(len(num_scheduled)))
                batch.resolve_pending(step.sampling_rows, sampled)
                np.testing.assert_array_equal(
                    batch.token_ids[pending_step.sampling_rows, pending_step.positions], sampled)
                batch.num_computed_tokens[pending_step.sampling_rows] -= 1  # it never ran


def test_rows_are_looked_up_again_once_a_request_comes_or_goes() -> None:
    batch = InputBatch(MAX_REQS, MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu"))

    def add(req_id: str) -> None:
        batch.add_request(NewRequestData(req_id=req_id, prompt_token_ids=[1, 2], output_token_ids=[],
                                         sampling_params=SamplingParams(), block_ids=[0], num_computed_tokens=0))

    add("a")
    add("b")
    first = batch.rows_of(["a", "b"]).tolist()
    assert batch.rows_of(["b", "a"]).tolist() == first[::-1]
    assert batch.rows_of(["a", "b"]).tolist() == first
    batch.remove_request("a")
    with pytest.raises(KeyError):  # gone: not answered from the last lookup
        batch.rows_of(["a", "b"])
    add("c")  # takes a's row
    add("a")  # comes back in another row
    assert batch.rows_of(["a", "b"]).tolist() == [batch.row_of["a"], batch.row_of["b"]] != first
    with pytest.raises(ValueError):  # shared between steps: nobody may write into it
        batch.rows_of(["a", "b"])[0] = 0


def test_resolve_pending_skips_rows_given_to_another_request() -> None:
    batch = InputBatch(MAX_REQS, MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu"))
    for req_id in "abc":
        batch.add_request(NewRequestData(req_id=req_id, prompt_token_ids=[1, 2, 3], output_token_ids=[],
                                         sampling_params=SamplingParams(), block_ids=[0], num_computed_tokens=0))
    rows = np.array([batch.row_of[r] for r in "abc"])
    batch.append_pending(rows)
    batch.remove_request("b")
    batch.add_request(NewRequestData(req_id="d", prompt_token_ids=[7, 8], output_token_ids=[],
                                     sampling_params=SamplingParams(), block_ids=[0], num_computed_tokens=0))
    assert batch.row_of["d"] == rows[1]
    batch.resolve_pending(rows, np.array([10, 11, 12]))
    assert batch.token_ids[rows[0], :4].tolist() == [1, 2, 3, 10]
    assert batch.token_ids[rows[2], :4].tolist() == [1, 2, 3, 12]
    assert batch.token_ids[rows[1], :3].tolist() == [7, 8, 3] and batch.num_tokens[rows[1]] == 2  # b's 3 is stale
    assert (batch.pending[rows] == -1).all()


def test_samples_plainly_is_the_per_step_check_made_once_per_request() -> None:
    """A decode step samples in a CUDA graph when every row samples plainly; the flag set when a
    request comes must equal the check the model runner made over the step's rows each step."""
    cases = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9),
             SamplingParams(temperature=0.0, top_k=5), SamplingParams(top_k=5), SamplingParams(min_p=0.1),
             SamplingParams(logprobs=0), SamplingParams(repetition_penalty=1.2), SamplingParams(seed=3),
             SamplingParams(temperature=0.0, logit_bias={1: 1.0})]
    batch = InputBatch(len(cases), MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu"))
    for i, params in enumerate(cases):
        batch.add_request(NewRequestData(req_id=str(i), prompt_token_ids=[1], output_token_ids=[],
                                         sampling_params=params, block_ids=[0], num_computed_tokens=0))
    rows = batch.rows_of([str(i) for i in range(len(cases))])
    filtered = filtered_rows(batch.temperature[rows], batch.top_k[rows], batch.top_p[rows], batch.min_p[rows])
    per_step = ~(filtered | batch.processes_logits[rows] | (batch.num_logprobs[rows] >= 0))
    assert batch.samples_plainly[rows].tolist() == per_step.tolist()
    assert per_step.tolist() == [True, True, False, True, False, False, False, False, True, False]
