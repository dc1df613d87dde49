"""Verifying draft tokens so that the output follows the target model's distribution exactly.

A request with k drafts d_1..d_k runs k + 1 positions in one forward; position j's logits are the
target's distribution p_j for the token after d_1..d_(j-1). The output is the accepted drafts
d_1..d_a followed by one token of the target's own: at the first rejected position a + 1 a token
from the residual distribution, or, when all k are accepted, a bonus token from p_(k+1).

Two ways, both exact:

* One-hot drafts (n-gram lookup, a greedy draft model) -- `verify_against_samples`: sample the
  target's token t_j at every position with the ordinary sampler, accept d_j while t_j == d_j, and
  output t at the first mismatch. P(accept d_j) = p_j(d_j), and given a rejection t_j is p_j
  conditioned on "not d_j" -- exactly the rejection sampler for a one-hot draft distribution
  (accept with min(1, p/q) = p(d), residual = normalize(max(0, p - onehot(d))) = p with d removed).
  Greedy rows take the argmax, so greedy output is token-identical to no speculation; seeded rows
  draw each position with the seed of that position (sampler.position_seed), so a seeded request
  samples the very tokens it would without speculation (on the same sampler path).
* Draft distributions q (a sampling draft model) -- `rejection_sample`: accept d_j with
  probability min(1, p_j(d_j) / q_j(d_j)); on rejection draw from normalize(max(0, p_j - q_j)).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from minivllm.worker import ops


def verify_against_samples(target_token_ids: Sequence[int], draft_token_ids: Sequence[Sequence[int]]
                           ) -> tuple[list[list[int]], list[int]]:
    """target_token_ids: the target's sampled (or argmax) token at every position, request by
    request (k_i + 1 per request); draft_token_ids: each request's k_i drafts.
    Returns each request's accepted drafts and the token that follows them."""
    num_positions = sum(len(drafts) + 1 for drafts in draft_token_ids)
    if num_positions != len(target_token_ids):
        raise ValueError(f"{len(target_token_ids)} target tokens for {num_positions} positions")
    accepted: list[list[int]] = []
    next_tokens: list[int] = []
    start = 0
    for drafts in draft_token_ids:
        num_accepted = 0
        for draft in drafts:
            if target_token_ids[start + num_accepted] != draft:
                break
            num_accepted += 1
        accepted.append(list(drafts[:num_accepted]))
        next_tokens.append(int(target_token_ids[start + num_accepted]))
        start += len(drafts) + 1
    return accepted, next_tokens


def _exponential_race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of (unnormalized, non-negative) probs: argmax(probs / E), E ~ Exp(1)."""
    noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return ops.argmax(probs / noise)


@torch.no_grad()
def rejection_sample(target_probs: torch.Tensor, draft_token_ids: Sequence[Sequence[int]],
                     draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None
                     ) -> tuple[list[list[int]], list[int]]:
    """The standard speculative-sampling rule (Leviathan et al., Chen et al.).

    target_probs [sum(k_i + 1), vocab]: each request's k_i + 1 positions in turn.
    draft_probs [sum(k_i), vocab] or None for one-hot drafts (q(d) = 1, residual = p without d).
    Returns each request's accepted drafts and the token that follows them."""
    device = target_probs.device
    counts = np.array([len(d) for d in draft_token_ids], dtype=np.int64)
    flat_drafts = np.fromiter((t for d in draft_token_ids for t in d), dtype=np.int64, count=int(counts.sum()))
    starts = np.cumsum(counts + 1) - (counts + 1)
    # Target rows of the draft positions (the first k_i of each request) and of the bonus positions.
    draft_rows = np.repeat(starts, counts) + (np.arange(len(flat_drafts)) - np.repeat(np.cumsum(counts) - counts, counts))
    bonus_rows = starts + counts
    draft_index = torch.from_numpy(draft_rows).to(device)
    drafts = torch.from_numpy(flat_drafts).to(device)
    p_draft_pos = target_probs[draft_index].float()
    p_d = p_draft_pos.gather(1, drafts[:, None])[:, 0]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        residual = p_draft_pos.scatter(1, drafts[:, None], 0.0)
    else:
        q = draft_probs.float()
        q_d = q.gather(1, drafts[:, None])[:, 0]
        residual = (p_draft_pos - q).clamp_min_(0.0)
    # p == q exactly leaves no residual mass, but then a rejection has probability 0 anyway.
    empty = residual.sum(dim=-1) <= 0
    residual = torch.where(empty[:, None], p_draft_pos, residual)
    uniform = torch.rand(p_d.shape, device=device, generator=generator)
    accept = (uniform * q_d < p_d).tolist()  # u < p(d) / q(d), without dividing by a tiny q
    recovered = _exponential_race(residual, generator).tolist() if len(flat_drafts) else []
    bonus = _exponential_race(target_probs[torch.from_numpy(bonus_rows).to(device)].float(), generator).tolist()

    accepted: list[list[int]] = []
    next_tokens: list[int] = []
    offset = 0
    for i, k in enumerate(counts.tolist()):
        num_accepted = 0
        while num_accepted < k and accept[offset + num_accepted]:
            num_accepted += 1
        accepted.append(flat_drafts[offset:offset + num_accepted].tolist())
        next_tokens.append(recovered[offset + num_accepted] if num_accepted < k else bonus[i])
        offset += k
    return accepted, next_tokens
