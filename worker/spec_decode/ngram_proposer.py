"""N-gram (prompt lookup) proposer: drafts copied from the request's own earlier tokens.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens are looked up earlier
in the sequence; at the most recent earlier occurrence, the (up to) k tokens that followed it
are the drafts. Outputs that quote their prompt (editing, extraction, summaries, code) repeat
long runs, which this finds for the cost of a few numpy comparisons on the host.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: np.ndarray, max_drafts: int | None = None) -> list[int]:
        """Drafts (maybe none) to follow token_ids [num_tokens]."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens < self.min_n + 1:
            return []
        # Candidate match ends: earlier places holding the last token (with a token after them).
        ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
        if not len(ends):
            return []
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            candidates = ends[ends >= n - 1]
            if not len(candidates):
                continue
            # Compare the n - 1 tokens before each candidate end with those before the last token.
            matched = np.ones(len(candidates), dtype=bool)
            for back in range(1, n):
                matched &= token_ids[candidates - back] == token_ids[num_tokens - 1 - back]
                if not matched.any():
                    break
            hits = candidates[matched]
            if len(hits):
                start = int(hits[-1]) + 1  # the most recent occurrence
                return token_ids[start:start + k].tolist()
        return []
