"""The scheduler's command-line flags reach the engine arguments (no engine started)."""

from __future__ import annotations

from minivllm.frontend.cli import build_parser, engine_kwargs


def parse(*flags: str) -> dict:
    return engine_kwargs(build_parser().parse_args(["generate", "--model", "m", *flags, "Hello"]))


def test_scheduler_flag_defaults_match_the_llm_defaults() -> None:
    kwargs = parse()
    assert kwargs["enable_prefix_caching"] is True
    assert kwargs["scheduling_policy"] == "fcfs"
    assert kwargs["long_prefill_token_threshold"] == 0
    assert kwargs["max_num_batched_tokens"] is None  # resolved by EngineConfig.create per policy


def test_scheduler_flags() -> None:
    kwargs = parse("--no-enable-prefix-caching", "--scheduling-policy", "priority",
                   "--long-prefill-token-threshold", "64", "--max-num-batched-tokens", "512")
    assert (kwargs["enable_prefix_caching"], kwargs["scheduling_policy"]) == (False, "priority")
    assert (kwargs["long_prefill_token_threshold"], kwargs["max_num_batched_tokens"]) == (64, 512)
    assert parse("--enable-prefix-caching")["enable_prefix_caching"] is True
    assert parse("--scheduling-policy", "v0")["scheduling_policy"] == "v0"


def test_help_documents_the_scheduler_flags() -> None:
    for command in ("generate", "engine"):
        text = build_parser()._subparsers._group_actions[0].choices[command].format_help()
        for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching", "--scheduling-policy",
                     "--long-prefill-token-threshold"):
            assert flag in text


def test_speculative_and_pipeline_flags_reach_the_engine_arguments() -> None:
    kwargs = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                   "--pipeline-parallel-size", "2")
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert kwargs["pipeline_parallel_size"] == 2
    assert parse()["speculative_config"] is None and parse()["pipeline_parallel_size"] == 1
