"""Logprobs of the sampled tokens: each one's log-probability and rank under the model's raw
distribution (log-softmax of the logits before any penalty, temperature or filter, as vLLM V1
reports by default), plus the top-k alternatives a request asked for."""

from __future__ import annotations

import numpy as np
import torch

from minivllm.protocol.messages import TokenLogprobs


def sampled_logprobs(raw_logits: torch.Tensor, sampled: torch.Tensor,
                     num_logprobs: np.ndarray) -> list[TokenLogprobs | None] | None:
    """raw_logits [n, vocab], sampled [n]; num_logprobs [n] (-1: not asked). None if nobody asked."""
    wanted = np.flatnonzero(num_logprobs >= 0)
    if not len(wanted):
        return None
    index = torch.from_numpy(wanted).to(raw_logits.device)
    logprobs = torch.log_softmax(raw_logits[index].float(), dim=-1)
    chosen = sampled[index]
    chosen_logprobs = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    k = int(num_logprobs[wanted].max())
    top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen[:, None][:, :0])
    chosen_l, chosen_lp_l, ranks_l = chosen.tolist(), chosen_logprobs[:, 0].tolist(), ranks.tolist()
    top_ids_l, top_lp_l = top_ids.tolist(), top_logprobs.tolist()
    results: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    for j, i in enumerate(wanted):
        n = int(num_logprobs[i])
        results[i] = TokenLogprobs(token_ids=[chosen_l[j], *top_ids_l[j][:n]],
                                   logprobs=[chosen_lp_l[j], *top_lp_l[j][:n]], sampled_rank=ranks_l[j])
    return results
