"""Prefill/decode instances started and discovered through Ray.

    minivllm proxy --model DIR --ray-prefill-instances 1 --ray-decode-instances 2 [--serve-args "..."]

starts each instance as a Ray actor (one GPU each on a GPU cluster, one CPU otherwise; Ray picks
the node) that runs `minivllm serve --kv-transfer-role producer|consumer` on its node, bound to the
node's address, and routes over them. The actors are named `prefill-<i>` / `decode-<i>` in a Ray
namespace (--ray-namespace), so another proxy, anywhere in the cluster, finds the same instances
with `minivllm proxy --ray-namespace NS` alone (discovery: no URL is typed anywhere). Like the Ray
executor, it joins the cluster on this host ($RAY_ADDRESS names another), or starts a local one.

The launching proxy owns the actors: when it exits, Ray ends them, and each actor's `serve`
process dies with its actor (PR_SET_PDEATHSIG), so nothing outlives it. An instance that dies is
seen by the proxy's health checks like any other (its URL stops answering).
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
DEFAULT_NAMESPACE = "minivllm-pd"
# --kv-transfer-role of each kind of instance
KV_TRANSFER_ROLES = {"prefill": "producer", "decode": "consumer"}


@dataclass
class InstanceInfo:
    role: str
    name: str
    url: str
    node_ip: str


class _PDInstance:
    """One `minivllm serve` process on the actor's node. (Decorated with ray.remote on first use, so
    importing this module needs no Ray.)"""

    def __init__(self, role: str, name: str, model: str, serve_args: list[str], startup_timeout_s: float) -> None:
        import ray

        from minivllm.protocol.ipc import die_with_parent

        self.role, self.name = role, name
        self.node_ip = ray.util.get_node_ip_address()
        port, kv_port = _free_port(self.node_ip), _free_port(self.node_ip)
        self.url = f"http://{self.node_ip}:{port}"
        argv = [sys.executable, "-m", "minivllm.frontend.cli", "serve", "--model", model,
                "--host", self.node_ip, "--port", str(port), "--kv-transfer-role", KV_TRANSFER_ROLES[role]]
        if role == "prefill":  # where decode instances pull from: this node, a port free on it
            argv += ["--kv-ip", self.node_ip, "--kv-port", str(kv_port)]
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"minivllm-ray-{name}-{port}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*argv, *serve_args], stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} on {self.node_ip}: `minivllm serve` exited with "
                                   f"{self.proc.returncode}:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} on {self.node_ip} was not up in {timeout_s:g} s:\n{self._log_tail()}")
            time.sleep(0.2)

    def _log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-lines:])

    def info(self) -> dict:
        return {"role": self.role, "name": self.name, "url": self.url, "node_ip": self.node_ip,
                "alive": self.proc.poll() is None}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RayPDInstances:
    """The proxy's instances as Ray actors: launched (and owned) by this process, or discovered."""

    def __init__(self, namespace: str = DEFAULT_NAMESPACE) -> None:
        from minivllm.core.ray_executor import connect_ray

        import ray

        self.namespace = namespace
        self.connected_here = connect_ray()
        self.actors: list = []  # the ones this process launched (it removes them on close)
        self.ray = ray

    def launch(self, model: str, num_prefill: int, num_decode: int, serve_args: list[str],
               startup_timeout_s: float = 600.0) -> list[InstanceInfo]:
        """Start the instances (all at once; each actor's constructor returns once its server is up)."""
        ray = self.ray
        taken = {name for name, _ in self._named_actors()}
        on_gpus = ray.cluster_resources().get("GPU", 0) > 0
        resources = {"num_gpus": 1, "num_cpus": 0} if on_gpus else {"num_cpus": 1}
        remote_class = ray.remote(_PDInstance)
        env = {"env_vars": {k: v for k, v in os.environ.items() if k.startswith("MINIVLLM_") or k == "PYTHONPATH"}}
        starting = []
        for role, count in (("prefill", num_prefill), ("decode", num_decode)):
            for i in range(count):
                name = f"{role}-{i}"
                if name in taken:
                    raise ValueError(f"the Ray namespace {self.namespace!r} already has an instance named {name!r} "
                                     "(another proxy's): use another --ray-namespace, or attach to those "
                                     "with --ray-namespace alone")
                actor = remote_class.options(name=name, namespace=self.namespace, max_restarts=0,
                                             runtime_env=env, **resources).remote(
                    role, name, os.path.abspath(model), serve_args, startup_timeout_s)
                self.actors.append(actor)
                starting.append(actor)
        try:
            infos = ray.get([actor.info.remote() for actor in starting], timeout=startup_timeout_s + 60)
        except Exception:
            self.close()
            raise
        for info in infos:
            logger.warning("%s: %s on node %s", info["name"], info["url"], info["node_ip"])
        return [InstanceInfo(i["role"], i["name"], i["url"], i["node_ip"]) for i in infos]

    def discover(self) -> list[InstanceInfo]:
        """The instances running under this namespace (launched by any proxy in the cluster)."""
        ray = self.ray
        handles = [ray.get_actor(name, namespace=self.namespace) for name, _ in self._named_actors()]
        infos = ray.get([h.info.remote() for h in handles], timeout=60)
        return [InstanceInfo(i["role"], i["name"], i["url"], i["node_ip"]) for i in infos if i["alive"]]

    def _named_actors(self) -> list[tuple[str, str]]:
        names = self.ray.util.list_named_actors(all_namespaces=True)
        return [(a["name"], a["namespace"]) for a in names
                if a["namespace"] == self.namespace and a["name"].split("-")[0] in ROLES]

    def close(self) -> None:
        for actor in self.actors:
            try:
                self.ray.get(actor.stop.remote(), timeout=40)
            except Exception as e:  # noqa: BLE001 - killed below either way
                logger.debug("stopping an instance failed: %s", e)
            self.ray.kill(actor)
        self.actors = []
        if self.connected_here:
            self.ray.shutdown()
            self.connected_here = False


def urls_by_role(infos: list[InstanceInfo]) -> tuple[list[str], list[str]]:
    prefill = sorted((i for i in infos if i.role == "prefill"), key=lambda i: i.name)
    decode = sorted((i for i in infos if i.role == "decode"), key=lambda i: i.name)
    return [i.url for i in prefill], [i.url for i in decode]


def parse_serve_args(text: str | None) -> list[str]:
    argv = shlex.split(text or "")
    for flag in ("--host", "--port", "--kv-transfer-role", "--kv-ip", "--kv-port", "--model"):
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            raise ValueError(f"--serve-args must not set {flag}: each Ray instance chooses its own")
    return argv
