"""Per-request changes to the logits before sampling (vLLM's meaning and order):

  min_tokens          stop tokens (EOS unless ignore_eos, and stop_token_ids) get -inf until the
                      request has min_tokens output tokens
  logit_bias          added to the listed tokens' logits
  allowed_token_ids   every other token gets -inf
  bad_words           a bad word's last token gets -inf whenever the output ends with the tokens
                      before it (a one-token word: always); the words come tokenized from the frontend
  repetition_penalty  tokens in the prompt or output: logit / p if positive, logit * p if not
  frequency_penalty   minus penalty x the token's count in the output
  presence_penalty    minus penalty if the token occurs in the output at all

Only rows that ask for one of these are touched, each feature in one batched tensor operation over
its rows (index lists are flattened on the host first). Greedy rows are affected too, as in vLLM.
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.worker.input_batch import InputBatch


def apply_logits_processors(logits: torch.Tensor, batch: InputBatch, rows: np.ndarray) -> torch.Tensor:
    """logits [n, vocab] of the persistent-batch `rows`; returns them (fp32) with the changes made."""
    process = batch.processes_logits[rows]
    if not process.any():
        return logits
    logits = logits.to(torch.float32, copy=True)  # the raw logits stay intact (logprobs read them)
    device, vocab_size = logits.device, logits.shape[1]
    which = np.flatnonzero(process)  # positions in `rows`
    num_output = batch.num_tokens[rows[which]] - batch.num_prompt_tokens[rows[which]]

    def scatter(entries: list[tuple[int, list[int], list[float] | float]]) -> tuple[torch.Tensor, ...]:
        """(position, token ids, values) triples flattened to index/value tensors."""
        positions = np.concatenate([np.full(len(tokens), i) for i, tokens, _ in entries])
        tokens = np.concatenate([np.asarray(t, dtype=np.int64) for _, t, _ in entries])
        values = np.concatenate([np.broadcast_to(np.asarray(v, dtype=np.float32), (len(t),)) for _, t, v in entries])
        return (torch.from_numpy(positions).to(device), torch.from_numpy(tokens).to(device),
                torch.from_numpy(values).to(device))

    # min_tokens: hold the stop tokens back.
    held = [(int(which[j]), batch.min_tokens_stop_ids[rows[which[j]]], float("-inf"))
            for j in np.flatnonzero(num_output < batch.min_tokens[rows[which]])]
    held = [entry for entry in held if len(entry[1])]
    if held:
        positions, tokens, values = scatter(held)
        logits[positions, tokens] = values

    biased = [(int(i), list(batch.logit_bias[rows[i]]), list(batch.logit_bias[rows[i]].values()))
              for i in which if batch.logit_bias[rows[i]]]
    if biased:
        positions, tokens, values = scatter(biased)
        logits.index_put_((positions, tokens), values, accumulate=True)

    allowed = [(int(i), batch.allowed_token_ids[rows[i]], 0.0) for i in which if batch.allowed_token_ids[rows[i]]]
    if allowed:
        positions, tokens, _ = scatter(allowed)
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[positions, tokens] = True
        restricted = torch.zeros(logits.shape[0], dtype=torch.bool, device=device)
        restricted[positions] = True
        logits.masked_fill_(~keep & restricted[:, None], float("-inf"))

    banned = [(int(i), tokens, float("-inf")) for i in which
              if batch.bad_words_token_ids[rows[i]] and (tokens := _bad_word_endings(batch, int(rows[i])))]
    if banned:
        positions, tokens, values = scatter(banned)
        logits[positions, tokens] = values

    penalized = which[batch.penalized[rows[which]]]
    if len(penalized):
        _apply_penalties(logits, batch, rows, penalized, vocab_size)
    return logits


def _bad_word_endings(batch: InputBatch, row: int) -> list[int]:
    """The last tokens of the row's bad words whose other tokens the output currently ends with."""
    output = batch.token_ids[row, batch.num_prompt_tokens[row]:batch.num_tokens[row]]
    endings = []
    for word in batch.bad_words_token_ids[row]:  # a few words per request that asked; no tensor work
        prefix_len = len(word) - 1
        if prefix_len == 0 or (prefix_len <= len(output) and output[len(output) - prefix_len:].tolist() == word[:-1]):
            endings.append(word[-1])
    return endings


def _token_counts(batch: InputBatch, rows: np.ndarray, start: np.ndarray, end: np.ndarray, vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] counts of each row's tokens token_ids[row, start:end]."""
    width = max(int((end - start).max()), 1)
    offsets = np.arange(width)
    index = start[:, None] + offsets[None, :]
    valid = index < end[:, None]
    tokens = np.where(valid, batch.token_ids[rows[:, None], np.minimum(index, batch.token_ids.shape[1] - 1)],
                      vocab_size)  # padding counts into an extra column, dropped below
    counts = torch.zeros(len(rows), vocab_size + 1, device=device)
    counts.scatter_add_(1, torch.from_numpy(tokens).to(device), torch.ones(tokens.shape, device=device))
    return counts[:, :vocab_size]


def _apply_penalties(logits: torch.Tensor, batch: InputBatch, rows: np.ndarray, positions: np.ndarray,
                     vocab_size: int) -> None:
    device = logits.device
    batch_rows = rows[positions]
    prompt_len, num_tokens = batch.num_prompt_tokens[batch_rows], batch.num_tokens[batch_rows]
    output_counts = _token_counts(batch, batch_rows, prompt_len, num_tokens, vocab_size, device)
    prompt_seen = _token_counts(batch, batch_rows, np.zeros_like(prompt_len), prompt_len, vocab_size, device) > 0
    index = torch.from_numpy(positions).to(device)
    x = logits[index]

    def column(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values[batch_rows].astype(np.float32)).to(device)[:, None]

    repetition = column(batch.repetition_penalty)
    seen = prompt_seen | (output_counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - column(batch.frequency_penalty) * output_counts
    x = x - column(batch.presence_penalty) * (output_counts > 0)
    logits[index] = x
