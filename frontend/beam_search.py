"""Beam search on top of the engine, as vLLM V1 does it: no beam logic in the engine at all.

Each step sends every live beam of every prompt to the engine as a one-token request that asks
for the top logprobs (2 x beam_width alternatives), all in one batch; the prefix cache makes the
beams' shared prefixes cheap. The frontend expands each beam by those alternatives and keeps the
best beam_width by cumulative logprob.

Which hypotheses count, and how they are ranked, follow HF transformers' beam search (the
vectorized one, transformers >= 4.50) so the results can be checked against it token for token:
  - a beam ends when one of the step's beam_width best expansions (by cumulative logprob) is EOS;
    vLLM keeps every EOS expansion among the 2 x beam_width alternatives instead, which can
    return hypotheses plain beam search never had on its beam;
  - the final ranking divides the cumulative logprob by (generated tokens, EOS included) **
    length_penalty; vLLM divides by (prompt + generated tokens, EOS excluded) ** length_penalty,
    the formula of older transformers.
The search stops after max_tokens steps, or earlier once no live beam can beat the beam_width
finished ones any more (an exact bound, as HF's early_stopping="never": the result is the same
as running every step).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from minivllm.frontend.outputs import Logprob
from minivllm.protocol.sampling_params import MAX_LOGPROBS

# A beam holds at most this many alternatives per step: the engine returns up to MAX_LOGPROBS.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """Settings of LLM.beam_search (vLLM's names and defaults). Invalid values raise ValueError.

    beam_width: hypotheses kept per prompt, and returned per prompt.
    max_tokens: most tokens generated per hypothesis.
    length_penalty: the score is cum_logprob / generated_tokens ** length_penalty; > 0 favours
        longer hypotheses, < 0 shorter ones, 0 ranks by cumulative logprob alone.
    ignore_eos: EOS is an ordinary token, so every hypothesis runs max_tokens tokens.
    temperature: of the engine's one-token requests. Scores always use the model's raw logprobs,
        so temperature > 0 only adds the engine's sampled token as one more candidate per beam.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}.")
        if isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite float, got {self.length_penalty!r}.")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}.")


@dataclass
class BeamSearchSequence:
    """One hypothesis. As in vLLM, `tokens` (and `text`) cover the prompt and the generated tokens."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per generated token: the alternatives
    cum_logprob: float = 0.0  # sum of the generated tokens' logprobs
    text: str | None = None  # filled in when returned
    finish_reason: str | None = None  # "stop" (EOS) or "length", when returned
    stop_reason: int | None = None  # the EOS id that ended it
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens alone."""
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The best beam_width hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(cum_logprob: float, num_generated_tokens: int, length_penalty: float) -> float:
    """HF transformers' length-penalized score: EOS counts as a generated token."""
    return cum_logprob / (num_generated_tokens**length_penalty)


# The engine, as beam search sees it: for each (prompt index, token sequence), the next token's
# alternatives (token id -> Logprob).
NextTokenLogprobs = Callable[[list[tuple[int, list[int]]]], list[dict[int, Logprob]]]


class BeamSearchInstance:
    """The search state of one prompt: its live beams and its finished hypotheses."""

    def __init__(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        self.beams = [BeamSearchSequence(tokens=list(prompt_token_ids), num_prompt_tokens=len(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.max_tokens = max_tokens
        self.num_steps = 0

    def done(self) -> bool:
        return not self.beams


def _score(seq: BeamSearchSequence, length_penalty: float) -> float:
    return beam_search_score(seq.cum_logprob, len(seq.tokens) - seq.num_prompt_tokens, length_penalty)


def run_beam_search(
    prompts_token_ids: Sequence[list[int]],
    params: BeamSearchParams,
    eos_token_ids: Sequence[int],
    next_token_logprobs: NextTokenLogprobs,
    max_tokens_per_prompt: Sequence[int] | None = None,
    on_step: Callable[[], None] | None = None,
) -> list[BeamSearchOutput]:
    """Beam search over all prompts at once; returns each prompt's best hypotheses, best first.

    next_token_logprobs runs one step for a batch of token sequences (LLM.beam_search sends them
    to the engine). max_tokens_per_prompt caps params.max_tokens per prompt (e.g. at
    max_model_len - prompt length).
    """
    eos = set() if params.ignore_eos else set(eos_token_ids)
    width, penalty = params.beam_width, params.length_penalty
    caps = max_tokens_per_prompt or [params.max_tokens] * len(prompts_token_ids)
    instances = [BeamSearchInstance(ids, min(params.max_tokens, cap)) for ids, cap in zip(prompts_token_ids, caps)]
    while True:
        live = [(i, beam) for i, instance in enumerate(instances) for beam in instance.beams]
        if not live:
            break
        alternatives = next_token_logprobs([(i, beam.tokens) for i, beam in live])
        candidates: list[list[BeamSearchSequence]] = [[] for _ in instances]
        for (i, beam), position in zip(live, alternatives):
            for token_id, logprob in position.items():
                candidates[i].append(BeamSearchSequence(
                    tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [position],
                    cum_logprob=beam.cum_logprob + logprob.logprob, num_prompt_tokens=beam.num_prompt_tokens))
        for instance, expansions in zip(instances, candidates):
            if not instance.done():
                _advance(instance, expansions, eos, width, penalty)
        if on_step is not None:
            on_step()
    return [_finish(instance, width, penalty) for instance in instances]


def _advance(instance: BeamSearchInstance, candidates: list[BeamSearchSequence], eos: set[int], width: int,
             penalty: float) -> None:
    """One step of one prompt: keep the best `width` non-EOS expansions as its beams; an EOS
    expansion among the best `width` overall finishes a hypothesis."""
    candidates.sort(key=lambda seq: seq.cum_logprob, reverse=True)
    for seq in candidates[:width]:
        if seq.tokens[-1] in eos:
            seq.finish_reason, seq.stop_reason = "stop", seq.tokens[-1]
            instance.completed.append(seq)
    instance.beams = [seq for seq in candidates if seq.tokens[-1] not in eos][:width]
    instance.num_steps += 1
    if instance.num_steps >= instance.max_tokens:  # the beams are hypotheses of full length now
        for seq in instance.beams:
            seq.finish_reason = "length"
        instance.completed.extend(instance.beams)
        instance.beams = []
    elif _cannot_improve(instance, width, penalty):
        instance.beams = []


def _cannot_improve(instance: BeamSearchInstance, width: int, penalty: float) -> bool:
    """Whether no live beam can ever score above the width-th best finished hypothesis. Logprobs
    are <= 0, so a beam's cum_logprob only falls; its best score is at its current length when
    penalty <= 0 and at max_tokens when penalty > 0."""
    if len(instance.completed) < width or not instance.beams:
        return not instance.beams
    worst_kept = sorted((_score(s, penalty) for s in instance.completed), reverse=True)[width - 1]
    best_length = instance.max_tokens if penalty > 0 else instance.num_steps
    best_possible = beam_search_score(max(b.cum_logprob for b in instance.beams), best_length, penalty)
    return best_possible <= worst_kept


def _finish(instance: BeamSearchInstance, width: int, penalty: float) -> BeamSearchOutput:
    best = sorted(instance.completed, key=lambda seq: _score(seq, penalty), reverse=True)[:width]
    return BeamSearchOutput(sequences=best)
