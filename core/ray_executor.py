"""The Ray executor (distributed_executor_backend="ray"): the workers are Ray actors, which a
placement group puts on the cluster's nodes, possibly other hosts than the EngineCore's.

    EngineCore --ZMQ (ipc://, or TCP + CURVE across nodes)--> RayWorker actors (worker/ray_worker.py)
               <--ZMQ-- rank 0's sampled tokens

Ray places the workers, gives rank 0's node address for the torch.distributed group, and reports
a dead actor or node; it carries nothing of the steps, which travel over ZMQ channels
(ChannelExecutor's transport, which the mp executor uses with socket pairs instead). The placement
group has one bundle per rank (one GPU on CUDA, one CPU otherwise); the group is packed onto one
node when a node has room for all of it (STRICT_PACK), else spread over as few nodes as fit (PACK),
as vLLM does. With pipeline parallelism there is one such group per stage (its TP group), and the
stages may land on different nodes.

Like ray.init(address="auto"), the executor joins the cluster that runs on this host ($RAY_ADDRESS,
if set, names it); with none, Ray starts a local one for this EngineCore alone. Actors and placement group are
owned by the EngineCore process: shutdown removes them, and Ray removes them if the process dies.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import msgspec

from minivllm.core.executor import ChannelExecutor, _bracket
from minivllm.protocol.config import EngineConfig

logger = logging.getLogger(__name__)

# Seconds to wait for the cluster to make room for the placement group before giving up.
PLACEMENT_TIMEOUT_ENV = "MINIVLLM_RAY_PLACEMENT_TIMEOUT"
DEFAULT_PLACEMENT_TIMEOUT_S = 120.0
# Environment variables the actors get from the EngineCore (they may start on other hosts).
_FORWARDED_ENV_PREFIXES = ("MINIVLLM_",)


def connect_ray() -> bool:
    """Join the Ray cluster ($RAY_ADDRESS, else the one running on this host), or start a local one.
    Returns whether this call connected (so shutdown should disconnect)."""
    import ray

    if ray.is_initialized():
        return False
    named = os.environ.get("RAY_ADDRESS")
    address = named or _running_cluster_address()
    if address is None:
        logger.info("no Ray cluster is running on this host: starting a local one")
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)  # never a stale record
        return True
    if named and not named.startswith("ray://") and not _reachable(named):
        # ray.init would retry for minutes; say what is wrong now
        raise ConnectionError(f"RAY_ADDRESS={named} names no reachable Ray cluster (is `ray start --head` "
                              "running there?); unset it to start a local cluster.")
    ray.init(address=address, logging_level=logging.WARNING)
    logger.info("joined the Ray cluster at %s", address)
    return True


def _running_cluster_address() -> str | None:
    """The address of the cluster `ray start` left on record on this host, if it answers. A record
    outlives a cluster that crashed, and ray.init(address="auto") would then retry for minutes."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        address = canonicalize_bootstrap_address("auto")
    except Exception:  # no record (ConnectionError), or Ray moved its helper: let Ray look itself
        return None
    if address and _reachable(address):
        return address
    if address:
        logger.warning("Ray's record names a cluster at %s that does not answer (a stale record): "
                       "starting a local one", address)
    return None


def _reachable(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at host:port (the cluster's GCS)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def wants_gpus(config: EngineConfig) -> bool:
    """Whether each worker takes a GPU: device "cuda", or "auto" on a cluster that has GPUs."""
    if config.device != "auto":
        return config.device == "cuda"
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


class RayExecutor(ChannelExecutor):
    blame_grace_s = 3.0  # Ray's news of a death travels through its control plane

    def __init__(self, config: EngineConfig) -> None:
        import ray

        super().__init__(config)
        self.actors: list[Any] = []
        self.run_refs: list[Any] = []
        self.placement_groups: list[Any] = []
        self.infos: list[dict[str, Any]] = []
        self.dead_reasons: dict[int, str] = {}
        self.connected_ray = connect_ray()
        try:
            self._place_workers(config)
            driver_node = ray.get_runtime_context().get_node_id()
            remote = any(info["node_id"] != driver_node for info in self.infos)
            # Workers on other nodes reach us over TCP at this node's address, CURVE-protected.
            self.bind_sockets(ray.util.get_node_ip_address() if remote else None)
            dist_init_address = None
            if self.world_size > 1:  # rank 0's node hosts the group's store
                port = ray.get(self.actors[0].free_port.remote())
                dist_init_address = f"tcp://{_bracket(self.infos[0]['node_ip'])}:{port}"
            config_json = msgspec.json.encode(config).decode()
            node_gpus: dict[str, list[str]] = {}  # node -> the GPUs of this engine's workers there
            for info in self.infos:
                node_gpus.setdefault(info["node_id"], []).extend(info["gpu_ids"])
            node_gpus = {node: sorted(set(ids), key=lambda i: (len(i), i)) for node, ids in node_gpus.items()}
            self.run_refs = [
                actor.run.remote(config_json, rank, self.work_addresses[rank], self.result_address,
                                 dist_init_address, self.curve_secret, node_gpus[info["node_id"]])
                for rank, (actor, info) in enumerate(zip(self.actors, self.infos))
            ]
            self._gather_replies("ready")
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d Ray worker(s) ready: %s (steps over %s)", self.world_size, self.describe_workers(),
                    "TCP + CURVE" if remote else "Unix sockets")

    def _place_workers(self, config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from minivllm.worker.ray_worker import RayWorker

        resource = "GPU" if wants_gpus(config) else "CPU"
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        per_node = [n["Resources"].get(resource, 0) for n in nodes]
        what = (f"tensor_parallel_size={self.tensor_parallel_size}" if self.pipeline_parallel_size == 1 else
                f"pipeline_parallel_size={self.pipeline_parallel_size} x "
                f"tensor_parallel_size={self.tensor_parallel_size}")
        if sum(per_node) < self.world_size:
            raise RuntimeError(
                f"{what} needs {self.world_size} x {resource} in the Ray cluster, "
                f"which has {sum(per_node):g} over {len(nodes)} node(s); add nodes (`ray start --address=...`) "
                "or lower tensor_parallel_size / pipeline_parallel_size.")
        # One placement group per pipeline stage (one in all without PP): a stage's TP group on one
        # node when a node has room for it (STRICT_PACK: its all-reduces stay on NVLink), else
        # over as few nodes as fit (PACK); the stages themselves go wherever Ray finds room, so
        # they spread over nodes when one node cannot hold them all (only activations cross).
        group_size = self.tensor_parallel_size if self.pipeline_parallel_size > 1 else self.world_size
        strategy = "STRICT_PACK" if max(per_node, default=0) >= group_size else "PACK"
        self.placement_groups = [placement_group([{resource: 1.0}] * group_size, strategy=strategy)
                                 for _ in range(self.world_size // group_size)]
        timeout = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, DEFAULT_PLACEMENT_TIMEOUT_S))
        try:
            ray.get([group.ready() for group in self.placement_groups], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the Ray cluster did not make room for {self.world_size} worker(s) of 1 {resource} each "
                f"({len(self.placement_groups)} group(s) of {group_size}, {strategy}) within {timeout:g} s: other "
                f"jobs hold its resources (available now: {ray.available_resources()}). Set "
                f"{PLACEMENT_TIMEOUT_ENV} to wait longer."
            ) from None
        env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV_PREFIXES)}
        actor_class = ray.remote(RayWorker)
        for rank in range(self.world_size):
            options: dict[str, Any] = dict(
                num_cpus=1 if resource == "CPU" else 0,
                num_gpus=1 if resource == "GPU" else 0,
                max_restarts=0,  # a worker's state (its KV cache, its group) cannot come back
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_groups[rank // group_size],
                    placement_group_bundle_index=rank % group_size),
            )
            if env:
                options["runtime_env"] = {"env_vars": env}
            self.actors.append(actor_class.options(**options).remote())
        self.infos = ray.get([actor.node_info.remote() for actor in self.actors])
        logger.info("placement group(s) (%s): %s", strategy,
                    ", ".join(f"rank {r} on {i['node_ip']} (node {i['node_id'][:8]})" for r, i in enumerate(self.infos)))

    # -- ChannelExecutor's hooks ---------------------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        return [info["pid"] for info in self.infos]

    def _where(self, rank: int) -> str:
        if rank >= len(self.infos):
            return f"worker {rank} (a Ray actor not placed yet)"
        info = self.infos[rank]
        return (f"worker {rank} (Ray actor, pid {info['pid']}{self.stage_note(rank)}) on node {info['node_ip']} "
                f"({info['node_id'][:8]})")

    def dead_worker(self, rank: int) -> str | None:
        if rank in self.dead_reasons:
            return self.dead_reasons[rank]
        if rank >= len(self.run_refs):
            return None
        import ray

        ready, _ = ray.wait([self.run_refs[rank]], timeout=0)
        if not ready:
            return None
        try:
            code = ray.get(ready[0])
            reason = f"{self._where(rank)} exited unexpectedly with code {code}"
        except ray.exceptions.RayError as e:
            if not self._node_alive(self.infos[rank]["node_id"]):
                cause = "its node is dead"
            elif isinstance(e, ray.exceptions.ActorUnavailableError):
                # What a node going down looks like at first: Ray marks the node dead only after
                # its health checks fail (~15 s), too late to tell the two apart here.
                cause = "the actor died or its node went down"
            else:
                cause = "the actor died"
            detail = " ".join(str(e).split())[:400]
            reason = f"{self._where(rank)} is gone: {cause} ({type(e).__name__}: {detail})"
        self.dead_reasons[rank] = reason
        return reason

    @staticmethod
    def _node_alive(node_id: str) -> bool:
        import ray

        try:
            return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())
        except Exception:  # the control plane itself is unreachable: say what we know
            return False

    def check_alive(self) -> None:
        # One ray.wait for all ranks (this runs every second while the engine waits).
        import ray

        if self.run_refs:
            ready, _ = ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=0)
            if ready:
                super().check_alive()

    def describe_workers(self) -> str:
        nodes = sorted({info["node_ip"] for info in self.infos})
        return f"Ray worker actors (pids {self.worker_pids}) on node(s) {', '.join(nodes)}"

    def stop_workers(self, timeout: float) -> None:
        import ray

        if not ray.is_initialized():
            return
        if self.run_refs:  # let them leave their group cleanly, then end the actors for good
            ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=timeout)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:  # already dead
                logger.debug("ray.kill: %s", e)
        if self.placement_groups:
            from ray.util.placement_group import remove_placement_group

            for group in self.placement_groups:
                try:
                    remove_placement_group(group)
                except Exception as e:
                    logger.warning("could not remove a placement group: %s", e)
        if self.connected_ray:
            ray.shutdown()
