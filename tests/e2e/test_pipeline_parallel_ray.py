"""Pipeline parallelism with distributed_executor_backend="ray" on a real local Ray cluster of two
simulated nodes (one CPU each, gloo; the helpers and fixtures of test_ray.py): one placement group
per stage, the two stages on different nodes, tokens as one mp worker gives them; a killed stage
actor is a clear EngineDeadError naming its rank, stage and node; nothing Ray holds is left behind.

Skipped when Ray is not installed.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from minivllm import LLM  # noqa: E402
from tests.procs import kill_during_generate  # noqa: E402

from tests.e2e.test_ray import (  # noqa: E402, F401  (fixtures are found by name)
    ENGINE_ARGS,
    GREEDY,
    PROMPTS,
    assert_nothing_left,
    ray_cluster,
    reference_tokens,
)


def test_pp2_across_two_nodes_equals_one_worker(ray_cluster, tiny_llama, reference_tokens) -> None:  # noqa: F811
    before = set(ray.util.placement_group_table())
    with LLM(tiny_llama, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE_ARGS) as llm:
        pids = [llm.engine_info.engine_pid, *llm.engine_info.worker_pids]
        groups = [g for pg_id, g in ray.util.placement_group_table().items() if pg_id not in before]
        # One group per stage (its TP group of one, packed), each on a node of its own.
        assert len(groups) == 2 and {g["strategy"] for g in groups} == {"STRICT_PACK"}
        assert len({node for g in groups for node in g["bundles_to_node_id"].values()}) == 2
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tokens == reference_tokens
    assert_nothing_left(pids)


@pytest.mark.parametrize("victim", [0, 1])
def test_killed_stage_actor_is_engine_dead_naming_rank_stage_and_node(ray_cluster, tiny_llama,  # noqa: F811
                                                                     victim: int) -> None:
    llm = LLM(tiny_llama, pipeline_parallel_size=2, distributed_executor_backend="ray",
              **{**ENGINE_ARGS, "max_model_len": 512, "max_num_batched_tokens": 16})
    pids = [llm.engine_info.engine_pid, *llm.engine_info.worker_pids]
    victim_pid = llm.engine_info.worker_pids[victim]
    node_ip = ray.util.get_node_ip_address()  # both simulated nodes share this host's address
    kill_during_generate(llm, victim_pid, f"worker {victim} \\(Ray actor, pid {victim_pid}, pipeline stage "
                                          f"{victim}\\) on node {node_ip}")
    llm.shutdown()
    assert_nothing_left(pids)
