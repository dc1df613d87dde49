"""run_beam_search on a fake model (no engine, no torch): its early stop changes nothing."""

from __future__ import annotations

import math
import random

import pytest

from minivllm.frontend.beam_search import BeamSearchParams, beam_search_score, run_beam_search
from minivllm.frontend.outputs import Logprob

VOCAB = 8
EOS = 0


def fake_model(seed: int):
    """Next-token logprobs that depend on the whole sequence (a seeded draw per prefix); EOS is
    likely enough that hypotheses end at different lengths. Returns all VOCAB alternatives."""

    def logprobs_of(tokens: list[int]) -> dict[int, Logprob]:
        rng = random.Random(hash((seed, *tokens)))
        logits = [rng.gauss(0.0, 2.0) for _ in range(VOCAB)]
        top = max(logits)
        norm = top + math.log(sum(math.exp(x - top) for x in logits))
        return {t: Logprob(x - norm) for t, x in enumerate(logits)}

    calls = []

    def next_token_logprobs(batch: list[tuple[int, list[int]]]) -> list[dict[int, Logprob]]:
        calls.append(len(batch))
        return [logprobs_of(tokens) for _, tokens in batch]

    return next_token_logprobs, calls


def reference_beam_search(step, prompt: list[int], width: int, max_tokens: int, penalty: float):
    """Plain beam search that always runs max_tokens steps (HF's rules, no early stop)."""
    beams, finished = [(prompt, 0.0)], []
    for n in range(1, max_tokens + 1):
        outs = step([(0, tokens) for tokens, _ in beams])
        candidates = sorted(((tokens + [t], cum + lp.logprob) for (tokens, cum), out in zip(beams, outs)
                             for t, lp in out.items()), key=lambda c: c[1], reverse=True)
        finished += [c for c in candidates[:width] if c[0][-1] == EOS]
        beams = [c for c in candidates if c[0][-1] != EOS][:width]
        if n == max_tokens:
            finished += beams
    ranked = sorted(finished, key=lambda c: beam_search_score(c[1], len(c[0]) - len(prompt), penalty), reverse=True)
    return [tokens for tokens, _ in ranked[:width]]


@pytest.mark.parametrize("penalty", [0.0, 1.0, 2.0, -0.5])
def test_early_stop_gives_the_same_result_as_running_every_step(penalty) -> None:
    saved_steps = 0
    for seed in range(30):
        step, calls = fake_model(seed)
        params = BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=penalty)
        got = run_beam_search([[5, 6]], params, [EOS], step)[0].sequences
        expected = reference_beam_search(fake_model(seed)[0], [5, 6], 3, 12, penalty)
        assert [s.tokens for s in got] == expected, f"seed {seed}"
        saved_steps += 12 - len(calls)
    if penalty <= 0.0:
        assert saved_steps > 0  # the bound does end searches early


def test_prompts_advance_together_and_finish_apart() -> None:
    step, calls = fake_model(7)
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    outputs = run_beam_search([[1], [2, 3]], params, [EOS], step, max_tokens_per_prompt=[5, 2])
    assert [len(s.output_token_ids) for s in outputs[0].sequences] == [5, 5]
    assert [len(s.output_token_ids) for s in outputs[1].sequences] == [2, 2]  # capped, e.g. by max_model_len
    # One batch per step for all prompts: the first step has one beam each, then two.
    assert calls == [2, 4, 2, 2, 2]
