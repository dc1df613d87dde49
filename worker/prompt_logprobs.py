"""Prompt logprobs: for every prompt token after the first, its log-probability and rank given the
tokens before it, plus the top-k alternatives (SamplingParams.prompt_logprobs).

They come out of prefill, a chunk at a time: position j's hidden state predicts token j + 1, so a
chunk [start, end) scores prompt tokens start + 1 .. end (the last of them is the next chunk's
first token, which is known: it is in the prompt). The last prompt position predicts the first
output token, not a prompt token, so it is left to the sampler. Chunks are kept in the worker
(`InputBatch.prompt_logprobs_chunks`) and sent together with the prompt's first sampled token, so
the scheduler and the wire see them once, whole.

Only requests that ask pay anything: with none in the batch this is one empty-set check.
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.protocol.messages import PromptLogprobs
from minivllm.worker.input_batch import InputBatch, StepInputs

# Positions scored at once: bounds the [positions, vocab] fp32 logits of a long prefill chunk.
_MAX_POSITIONS_PER_PASS = 512


def gather_prompt_logprobs(compute_logits, hidden_states: torch.Tensor, step: StepInputs,
                           batch: InputBatch) -> dict[str, PromptLogprobs]:
    """Score this step's prompt positions of the requests that asked; returns the finished ones'
    logprobs (their prompt ended in this step) by request id."""
    if not batch.prompt_logprobs_reqs:
        return {}
    step_index = {req_id: i for i, req_id in enumerate(step.req_ids)}
    query_starts, seq_lens = step.query_start_loc, step.seq_lens
    token_index, targets, owners, done = [], [], [], []
    # One iteration per request that asked (rare), not per token.
    for req_id in batch.prompt_logprobs_reqs:
        i = step_index.get(req_id)
        if i is None:
            continue
        row = batch.row_of[req_id]
        end = int(seq_lens[i])
        start = end - int(query_starts[i + 1] - query_starts[i])
        num_prompt = int(batch.num_prompt_tokens[row])
        positions = np.arange(start, min(end, num_prompt - 1))
        token_index.append(query_starts[i] + positions - start)
        targets.append(batch.token_ids[row, positions + 1])
        owners.append((req_id, row, len(positions)))
        if end >= num_prompt:
            done.append(req_id)
    if not owners:
        return {}

    index = np.concatenate(token_index)
    target = np.concatenate(targets)
    k = max(int(batch.num_prompt_logprobs[row]) for _, row, _ in owners)
    ids, logprobs, ranks = _score(compute_logits, hidden_states, index, target, k)

    offset = 0
    for req_id, row, count in owners:
        width = 1 + int(batch.num_prompt_logprobs[row])
        batch.prompt_logprobs_chunks[row].append(
            (ids[offset:offset + count, :width], logprobs[offset:offset + count, :width], ranks[offset:offset + count]))
        offset += count

    finished = {}
    for req_id in done:
        row = batch.row_of[req_id]
        chunks = batch.prompt_logprobs_chunks[row]
        finished[req_id] = PromptLogprobs(
            token_ids=np.concatenate([c[0] for c in chunks]).tolist(),
            logprobs=np.concatenate([c[1] for c in chunks]).tolist(),
            ranks=np.concatenate([c[2] for c in chunks]).tolist(),
        )
        batch.prompt_logprobs_chunks[row] = []
        batch.prompt_logprobs_reqs.discard(req_id)
    return finished


def _score(compute_logits, hidden_states: torch.Tensor, index: np.ndarray, target: np.ndarray,
           k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For hidden_states[index]: [n, 1 + k] ids (target, then the top-k), [n, 1 + k] logprobs and
    [n] ranks of the target, on the host."""
    n = len(index)
    ids = np.empty((n, 1 + k), dtype=np.int64)
    logprobs = np.empty((n, 1 + k), dtype=np.float32)
    ranks = np.empty(n, dtype=np.int64)
    device = hidden_states.device
    for lo in range(0, n, _MAX_POSITIONS_PER_PASS):
        hi = min(lo + _MAX_POSITIONS_PER_PASS, n)
        rows = torch.from_numpy(index[lo:hi]).to(device)
        wanted = torch.from_numpy(target[lo:hi]).to(device)
        # fp32 log-softmax of the raw logits, as for the sampled tokens' logprobs.
        lp = torch.log_softmax(compute_logits(hidden_states[rows]).float(), dim=-1)
        wanted_lp = lp.gather(1, wanted[:, None])
        top_lp, top_ids = lp.topk(k, dim=-1)
        ids[lo:hi, 0] = target[lo:hi]
        ids[lo:hi, 1:] = top_ids.cpu().numpy()
        logprobs[lo:hi, 0] = wanted_lp[:, 0].cpu().numpy()
        logprobs[lo:hi, 1:] = top_lp.cpu().numpy()
        ranks[lo:hi] = ((lp > wanted_lp).sum(dim=-1) + 1).cpu().numpy()
    return ids, logprobs, ranks
