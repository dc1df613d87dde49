"""A worker as a Ray actor (distributed_executor_backend="ray"; see core/ray_executor.py).

The actor is a host for the very loop a worker process runs (worker.run_worker): the RayExecutor
asks it where it landed, then calls run(), which serves the executor's ZMQ sockets until Shutdown.
Ray carries nothing of the steps; it only places the actor and tells the executor when it dies
(run()'s result then fails with the reason).

Ray sets CUDA_VISIBLE_DEVICES for each actor to the one GPU it was given; the worker uses that GPU,
whatever its rank (see run()).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import msgspec

from minivllm.protocol.config import EngineConfig


class RayWorker:
    """Decorated with ray.remote by the executor (so importing this module needs no Ray)."""

    def node_info(self) -> dict[str, Any]:
        """Where this actor runs: node IP and id, pid, and the GPUs Ray gave it."""
        import ray

        context = ray.get_runtime_context()
        return {
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": context.get_node_id(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        """A TCP port free on this actor's node now: rank 0 hosts the torch.distributed store there."""
        import ray

        with socket.socket(socket.AF_INET6 if ":" in ray.util.get_node_ip_address() else socket.AF_INET) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, config_json: str, rank: int, work_address: str, result_address: str,
            dist_init_address: str | None, curve_secret: str | None, node_gpu_ids: list[str] | None = None) -> int:
        """Serve the executor until Shutdown (blocks this actor); returns the exit code.

        node_gpu_ids: the GPUs Ray gave this engine's workers on this node. Ray leaves each actor
        only its own GPU visible; the worker makes its node's whole set visible (before CUDA starts)
        and takes its own GPU by its index there, as vLLM does, so that NCCL sees the peers it
        reaches over NVLink."""
        from minivllm.worker.worker import run_worker

        logging.basicConfig(level=os.environ.get("MINIVLLM_LOG_LEVEL", "INFO"),
                            format=f"%(levelname)s %(asctime)s [worker{rank}] %(name)s: %(message)s")
        config = msgspec.json.decode(config_json, type=EngineConfig)
        device_index = 0  # the one GPU Ray left visible (or the CPU)
        own = self.node_info()["gpu_ids"]
        if node_gpu_ids and len(own) == 1 and own[0] in node_gpu_ids:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpu_ids)
            device_index = node_gpu_ids.index(own[0])
        return run_worker(config, rank, work_address, result_address, dist_init_address,
                          device_index=device_index, curve_secret=curve_secret)
