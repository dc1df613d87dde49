"""The data-parallel load balancer: least loaded core wins, by the cores' reports plus what was
sent since; a waiting request weighs more than a running one; ties go to the emptier KV cache."""

from __future__ import annotations

from minivllm.frontend.dp_client import LoadBalancer, combine_stats
from minivllm.protocol.messages import EngineStats


def stats(waiting: int = 0, running: int = 0, kv: float = 0.0, blocks: int = 100, finished: int = 0) -> EngineStats:
    return EngineStats(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=kv, num_gpu_blocks=blocks,
                       num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0, num_prefill_tokens=0,
                       num_generation_tokens=0, num_finished_reqs=finished)


def send(balancer: LoadBalancer) -> int:
    core = balancer.pick()
    balancer.added(core)
    return core


def test_a_burst_between_reports_spreads_evenly() -> None:
    balancer = LoadBalancer(3)
    assert [send(balancer) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_reports_replace_what_they_counted_and_keep_later_adds() -> None:
    balancer = LoadBalancer(2)
    for _ in range(4):
        balancer.added(0)  # four requests to core 0...
    balancer.report_requested(0, now=1.0)  # ...all received before it answers this
    balancer.added(0)  # one more, after the question
    balancer.report_received(0, stats(running=1))  # three of the four finished already
    assert balancer.loads[0].unreported == 1
    assert balancer.loads[0].score() == (4 * 1 + 1, 0.0)
    balancer.report_requested(1, now=1.0)
    balancer.report_received(1, stats(running=6))  # six running elsewhere: still more than core 0's
    assert balancer.pick() == 0


def test_waiting_weighs_more_than_running_and_kv_breaks_ties() -> None:
    balancer = LoadBalancer(2)
    for core, report in enumerate([stats(waiting=1), stats(running=3)]):
        balancer.report_requested(core, now=0.0)
        balancer.report_received(core, report)
    assert balancer.pick() == 1  # 1 waiting (4) > 3 running
    for core, report in enumerate([stats(running=2, kv=0.7), stats(running=2, kv=0.2)]):
        balancer.report_requested(core, now=0.0)
        balancer.report_received(core, report)
    assert balancer.pick() == 1


def test_a_failed_report_keeps_the_counts() -> None:
    balancer = LoadBalancer(2)
    balancer.added(0)
    balancer.report_requested(0, now=0.0)
    assert not balancer.report_due(0, now=10.0)  # one question at a time
    balancer.report_received(0, None)
    assert balancer.loads[0].unreported == 1 and balancer.report_due(0, now=10.0)


def test_group_stats_add_up_and_kv_usage_is_over_all_blocks() -> None:
    combined = combine_stats([stats(running=2, kv=0.5, blocks=100, finished=3),
                              stats(waiting=1, kv=0.0, blocks=300, finished=4)])
    assert (combined.num_running_reqs, combined.num_waiting_reqs, combined.num_finished_reqs) == (2, 1, 7)
    assert combined.num_gpu_blocks == 400 and combined.kv_cache_usage == 50 / 400
