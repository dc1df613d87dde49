"""distributed_executor_backend="ray" on a real local Ray cluster of two simulated nodes
(ray.cluster_utils.Cluster, one CPU each, gloo): workers placed across both nodes give the tokens
one mp worker gives, for tensor and data parallelism; a killed actor, or a node taken down, is a
clear EngineDeadError naming the rank and node; and nothing Ray holds (actors, placement groups)
outlives the engine.

One cluster for the module (starting Ray costs seconds). Skipped when Ray is not installed.
"""

from __future__ import annotations

import os
import time

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from tests.procs import kill_during_generate, wait_gone  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(5 * i + j) % 400 + 1 for j in range(n)]} for i, n in enumerate([1, 7, 23, 40])]
ENGINE_ARGS = dict(max_model_len=128, max_num_batched_tokens=32, skip_tokenizer_init=True, device="cpu")


@pytest.fixture(scope="module")
def ray_cluster():
    """Two nodes of one CPU each: a group of two one-CPU workers must span both. The engine's
    processes find the cluster through RAY_ADDRESS; this process joins it to inspect its state."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1},
                                                           "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    cluster.wait_for_nodes()
    saved = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = saved
        cluster.shutdown()


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama) -> list[list[int]]:
    """One mp worker's greedy tokens."""
    with LLM(tiny_llama, **ENGINE_ARGS) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def our_placement_groups() -> list[dict]:
    return list(ray.util.placement_group_table().values())


def assert_nothing_left(pids: list[int], timeout: float = 20.0) -> None:
    """The engine's processes are gone, its placement groups removed, its actors dead."""
    assert wait_gone(pids, timeout=timeout) == []
    deadline = time.monotonic() + timeout
    while True:
        live_groups = [g for g in our_placement_groups() if g["state"] != "REMOVED"]
        # The GCS actor table (ray.util.state needs the dashboard, which this cluster leaves out).
        live_actors = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
        if not live_groups and not live_actors:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: placement groups {live_groups}, actors {live_actors}")
        time.sleep(0.2)


def test_tp2_across_two_nodes_equals_one_worker(ray_cluster, tiny_llama, reference_tokens) -> None:
    before = set(ray.util.placement_group_table())
    with LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_ARGS) as llm:
        pids = [llm.engine_info.engine_pid, *llm.engine_info.worker_pids]
        (group,) = [g for pg_id, g in ray.util.placement_group_table().items() if pg_id not in before]
        # No node holds both one-CPU bundles: PACK spreads the group over the two nodes.
        assert group["strategy"] == "PACK" and group["state"] == "CREATED"
        assert len(set(group["bundles_to_node_id"].values())) == 2
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tokens == reference_tokens
    assert_nothing_left(pids)


def test_dp2_on_ray_equals_one_engine(ray_cluster, tiny_llama, reference_tokens) -> None:
    before = set(ray.util.placement_group_table())
    prompts = PROMPTS * 2
    with LLM(tiny_llama, data_parallel_size=2, distributed_executor_backend="ray", **ENGINE_ARGS) as llm:
        pids = [*llm.client.engine_pids, *llm.engine_info.worker_pids]
        groups = [g for pg_id, g in ray.util.placement_group_table().items() if pg_id not in before]
        assert len(groups) == 2  # one per core, each on a node of its own (one CPU each)
        assert {g["strategy"] for g in groups} == {"STRICT_PACK"}
        assert len({node for g in groups for node in g["bundles_to_node_id"].values()}) == 2
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        finished = [core.call_utility("get_stats").get("num_finished_reqs", 0) for core in llm.client.cores]
    assert tokens == reference_tokens * 2
    assert all(n > 0 for n in finished) and sum(finished) == len(prompts)
    assert_nothing_left(pids)


def test_killed_actor_is_engine_dead_naming_rank_and_node(ray_cluster, tiny_llama) -> None:
    victim = 1
    llm = LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray",
              **{**ENGINE_ARGS, "max_model_len": 512, "max_num_batched_tokens": 16})
    pids = [llm.engine_info.engine_pid, *llm.engine_info.worker_pids]
    victim_pid = llm.engine_info.worker_pids[victim]
    node_ip = ray.util.get_node_ip_address()  # both simulated nodes share this host's address
    kill_during_generate(llm, victim_pid, f"worker {victim} \\(Ray actor, pid {victim_pid}\\) on node {node_ip}")
    llm.shutdown()
    assert_nothing_left(pids)


def test_dead_node_is_engine_dead_naming_it_and_leaves_nothing(ray_cluster, tiny_llama) -> None:
    """A TP=2 group spans both nodes; removing the second node (its raylet and every process of it,
    as a machine that goes down) mid-generate is an EngineDeadError within seconds, naming the
    worker and its node (Ray marks the node itself dead only after ~15 s of failed health checks,
    so the error says that the actor died or its node went down)."""
    [node_b] = list(ray_cluster.worker_nodes)
    llm = LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray",
              **{**ENGINE_ARGS, "max_model_len": 512, "max_num_batched_tokens": 16})
    pids = [llm.engine_info.engine_pid, *llm.engine_info.worker_pids]
    try:
        kill_during_generate(llm, lambda: ray_cluster.remove_node(node_b, allow_graceful=False),
                             r"worker [01] \(Ray actor, pid \d+\) on node [\d.]+ \(\w+\) is gone: "
                             r"(its node is dead|the actor died or its node went down)")
        llm.shutdown()
        assert_nothing_left(pids)
    finally:
        llm.shutdown()
        ray_cluster.add_node(num_cpus=1, resources={"node_b": 1})  # for any test after this one
        ray_cluster.wait_for_nodes()
