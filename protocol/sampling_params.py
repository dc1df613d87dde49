"""SamplingParams: how one request picks its tokens and when it stops (vLLM's meaning and defaults)."""

from __future__ import annotations

from enum import IntEnum

import msgspec


class RequestOutputKind(IntEnum):
    """What a streaming consumer (AsyncLLM.generate) receives, as in vLLM."""

    CUMULATIVE = 0  # every output holds all tokens / text so far
    DELTA = 1  # every output holds only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request sampling settings. Invalid values raise ValueError at construction.

    temperature 0 means greedy. top_k 0 or -1 means no top-k cut. max_tokens None means
    "until the model's maximum length". seed makes the request's samples reproducible
    whatever else shares its batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    # Only the frontend reads it (the engine streams token ids either way); an int on the wire.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        try:  # also takes the plain ints 0 / 1 / 2
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY), "
                             f"got {self.output_kind!r}.") from None
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (both: off) or >= 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}.")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}.")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
