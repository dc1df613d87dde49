"""A short soak of the engine boundary (benchmarks/soak_engine.py runs the long one): rounds of
fuzzing, a flood and a killed frontend against one keyed engine, while a real frontend keeps
checking its greedy answers."""

from __future__ import annotations

import pytest

from benchmarks.soak_engine import run_soak


def soak(model: str, seconds: float) -> dict:
    figures = run_soak(model, seconds, ["--max-model-len", "512", "--max-pending-requests", "64"])
    assert figures["engine_alive"]
    assert figures["messages_fuzzed"] >= 10_000 and figures["hostile_unanswered"] == 0
    assert figures["flood_unanswered"] == 0 and figures["flood_overloaded"] > 0
    assert figures["checks"] > 0 and figures["mismatches"] == 0
    assert figures["rss_peak_kb"] - figures["rss_start_kb"] < 200 * 1024
    return figures


def test_short_soak(tiny_llama) -> None:
    print(soak(tiny_llama, 1.0))  # one round


@pytest.mark.slow
def test_long_soak(tiny_llama) -> None:
    print(soak(tiny_llama, 300.0))
