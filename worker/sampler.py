"""Turn one step's logits into token ids, each row with its own sampling settings.

Everything is one set of batched tensor ops over the rows:
  temperature 0 -> argmax; otherwise logits / temperature,
  top-k then top-p (nucleus) masking, computed on one descending sort,
  then a draw by the "exponential race": argmax(probs / E) with E ~ Exponential(1) i.i.d.
  picks token i with probability probs[i] (it is the Gumbel-max trick in another form).
Only the noise E is per-request: a request with a `seed` draws its row from its own
torch.Generator, so its tokens do not depend on what else shares the batch; the rest draw
from one shared generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.protocol.sampling_params import SamplingParams
from minivllm.worker import ops


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for one step, as tensors on the logits' device."""

    temperature: torch.Tensor  # [n] float32; 0 = greedy
    top_k: torch.Tensor  # [n] int64; 0 = no cut (-1 is normalized to 0)
    top_p: torch.Tensor  # [n] float32; 1 = no cut
    min_p: torch.Tensor | None  # [n] float32 or None when no row uses it
    # Per row: the request's own generator (it has a seed) or None (use the shared one).
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
    ) -> "SamplingMetadata":
        return cls.from_arrays(
            np.array([p.temperature for p in params], dtype=np.float32),
            np.array([max(p.top_k, 0) for p in params], dtype=np.int64),
            np.array([p.top_p for p in params], dtype=np.float32),
            generators,
            device,
            min_p=np.array([p.min_p for p in params], dtype=np.float32),
        )

    @classmethod
    def from_arrays(
        cls,
        temperature: np.ndarray,
        top_k: np.ndarray,
        top_p: np.ndarray,
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        min_p: np.ndarray | None = None,
    ) -> "SamplingMetadata":
        """From per-row arrays (the persistent batch keeps them); top_k already 0 for "off"."""
        any_min_p = min_p is not None and bool(np.any(min_p > 0.0))
        return cls(
            temperature=torch.from_numpy(temperature).to(device, non_blocking=True),
            top_k=torch.from_numpy(top_k).to(device, non_blocking=True),
            top_p=torch.from_numpy(top_p).to(device, non_blocking=True),
            min_p=torch.from_numpy(min_p).to(device, non_blocking=True) if any_min_p else None,
            generators=list(generators),
            all_greedy=bool(np.all(temperature == 0.0)),
            any_greedy=bool(np.any(temperature == 0.0)),
            any_top_k=bool(np.any(top_k > 0)),
            any_top_p=bool(np.any(top_p < 1.0)),
        )


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        # Shared by every row without a seed of its own.
        self.generator = generator

    @torch.no_grad()
    def sample_rows(self, logits: torch.Tensor, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                    generators: Sequence[torch.Generator | None], seeds: np.ndarray,
                    min_p: np.ndarray) -> torch.Tensor:
        """The CUDA path: rows with no top-k/top-p go through one fused kernel
        (worker/fused_sampling.py, `seeds` are its per-row Philox seeds); the others through
        the torch ops below. Each row's tokens depend only on its own settings and seed."""
        from minivllm.worker.fused_sampling import fused_sample

        filtered = filtered_rows(temperature, top_k, top_p, min_p)
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        plain = np.flatnonzero(~filtered)
        if len(plain):
            fused_sample(logits, plain, temperature[plain], seeds[plain], out)
        rows = np.flatnonzero(filtered)
        if len(rows):
            metadata = SamplingMetadata.from_arrays(temperature[rows], top_k[rows], top_p[rows],
                                                    [generators[i] for i in rows], logits.device, min_p[rows])
            index = torch.from_numpy(rows).to(logits.device, non_blocking=True)
            out[index] = self(logits[index], metadata)
        return out

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits [n, vocab] -> sampled token ids [n] (int64)."""
        if metadata.all_greedy:  # (in the logits' own dtype: widening keeps every order and tie)
            return ops.argmax(logits)
        logits = logits.float()
        greedy_tokens = ops.argmax(logits) if metadata.any_greedy else None
        probs = self.compute_probs(logits, metadata)
        noise = self._exponential_noise(probs, metadata.generators)
        sampled_tokens = ops.argmax(probs.div_(noise))
        is_greedy = metadata.temperature == 0.0
        return sampled_tokens if greedy_tokens is None else torch.where(is_greedy, greedy_tokens, sampled_tokens)

    @staticmethod
    def compute_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution each row samples from: temperature, top-k / top-p, min-p applied
        (greedy rows get temperature 1 here; their callers take the argmax instead)."""
        logits = logits.float()
        is_greedy = metadata.temperature == 0.0
        temperature = torch.where(is_greedy, torch.ones_like(metadata.temperature), metadata.temperature)
        logits = logits / temperature[:, None]
        if metadata.any_top_k or metadata.any_top_p:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = torch.softmax(logits, dim=-1)
        if metadata.min_p is not None:  # drop tokens below min_p x the row's likeliest
            threshold = metadata.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _exponential_noise(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """Exponential(1) noise shaped like probs: seeded rows from their own generator."""
        noise = torch.empty_like(probs)
        if not any(generators):  # no seeded row (a generator is always true)
            noise.exponential_(generator=self.generator)
        else:
            shared_rows = [i for i, g in enumerate(generators) if g is None]
            # The only per-request loop: each seeded row advances its own generator.
            for i, generator in enumerate(generators):
                if generator is not None:
                    noise[i].exponential_(generator=generator)
            if shared_rows:
                rows = torch.tensor(shared_rows, device=probs.device)
                shared = torch.empty((len(shared_rows), probs.shape[1]), device=probs.device)
                noise[rows] = shared.exponential_(generator=self.generator)
        # exponential_ can return exactly 0; keep the division finite.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def filtered_rows(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """Per row, whether it draws from a filtered distribution (top-k, top-p or min-p), which only
    the torch path applies; greedy rows and plain temperature ones need no filter."""
    return (temperature > 0.0) & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))


def position_seed(request_seed: int, num_tokens: int) -> int:
    """The seed of a seeded request's draw for the token that follows its first num_tokens tokens."""
    return (int(request_seed) * 1_000_003 + int(num_tokens)) % (2**63 - 1)


def reseed_generators(generators: Sequence[torch.Generator | None], request_seeds: np.ndarray,
                      num_tokens: np.ndarray) -> None:
    """Seed each seeded row's generator from (its request's seed, its token count) before it draws:
    a token then depends on its position alone, not on how many draws came before it — so a
    request preempted and resumed, or scheduled differently, samples the same tokens."""
    for i in np.flatnonzero(request_seeds >= 0):  # seeded rows only: the others share one generator
        generators[i].manual_seed(position_seed(request_seeds[i], num_tokens[i]))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k, then outside its top-p nucleus.

    top_k [n] (0 = off), top_p [n] (1 = off). The nucleus is the smallest set of most likely
    tokens whose probability (after top-k) reaches top_p; the most likely token always stays.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab_size, device=logits.device)[None, :]

    k = torch.where(top_k > 0, top_k, vocab_size)
    drop = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))

    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability of strictly better tokens
    drop |= (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]

    # Back from sorted order to vocabulary order.
    drop_by_id = torch.empty_like(drop).scatter_(-1, sorted_ids, drop)
    return logits.masked_fill(drop_by_id, float("-inf"))
