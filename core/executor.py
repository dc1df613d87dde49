"""The executor: starts one worker process per GPU and talks to them over ZMQ.

Each worker gets its own PUSH socket for work (a SchedulerOutput is sent to every worker), and all
workers answer on one shared PULL socket. Only rank 0 returns sampled tokens (every rank samples
the same ones: see worker/models/parallel_layers.py). With several workers (tensor parallelism)
the executor also picks the loopback address at which they form their torch.distributed group.
While waiting for an answer the executor checks every second that its workers are still alive,
so a dead worker becomes a WorkerDiedError within about a second instead of a hang. A worker that
hangs instead (a deadlock, a stuck device, a stopped process) is caught by the step watchdog: a
step unanswered after config.execute_model_timeout_seconds becomes a WorkerHungError.
"""

from __future__ import annotations

import logging
import subprocess
import time
from typing import Any

import msgspec
import zmq

from minivllm.protocol.config import EngineConfig
from minivllm.protocol.ipc import free_loopback_tcp_address, new_ipc_address, remove_ipc_file, spawn_child, stop_child
from minivllm.protocol.messages import ModelRunnerOutput, SchedulerOutput, Shutdown, WorkerCall, WorkerReply
from minivllm.protocol.serial import encode, worker_output_decoder

logger = logging.getLogger(__name__)

POLL_MS = 1000


class WorkerDiedError(RuntimeError):
    """A worker process exited or reported a failure; the engine cannot go on."""


class WorkerHungError(WorkerDiedError):
    """The step watchdog fired: the workers did not answer a step in time."""


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        self.world_size = config.tensor_parallel_size
        self.step_timeout_s = config.execute_model_timeout_seconds
        self.hung = False
        self.ctx = zmq.Context()
        self.result_address = new_ipc_address("worker-results")
        self.result_socket = self.ctx.socket(zmq.PULL)
        self.result_socket.bind(self.result_address)
        self.work_addresses = [new_ipc_address(f"worker{rank}-in") for rank in range(self.world_size)]
        self.work_sockets = []
        for address in self.work_addresses:
            sock = self.ctx.socket(zmq.PUSH)
            sock.bind(address)
            self.work_sockets.append(sock)

        config_json = msgspec.json.encode(config).decode()
        dist_args = ["--dist-init-address", free_loopback_tcp_address()] if self.world_size > 1 else []
        self.procs: list[subprocess.Popen] = [
            spawn_child(
                "minivllm.worker.worker",
                ["--config", config_json, "--rank", str(rank),
                 "--work-address", self.work_addresses[rank], "--result-address", self.result_address,
                 *dist_args],
            )
            for rank in range(self.world_size)
        ]
        # Each worker says "ready" once its model is loaded (or reports why it could not).
        self._gather_replies("ready")
        logger.info("%d worker(s) ready (pids %s)", self.world_size, self.worker_pids)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call Worker.<method>(*args) on every worker; return their results by rank."""
        payload = encode(WorkerCall(method, list(args)))
        for sock in self.work_sockets:
            sock.send(payload)
        return self._gather_replies(method)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.receive_output()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Send a step to every worker without waiting (they queue steps and run them in order)."""
        payload = encode(scheduler_output)
        for sock in self.work_sockets:
            sock.send(payload)

    def receive_output(self) -> ModelRunnerOutput:
        """The sampled tokens of the oldest step submitted and not yet received."""
        message = self._receive(self.step_timeout_s)
        if not isinstance(message, ModelRunnerOutput):
            raise WorkerDiedError(f"expected a model output from rank 0, got {type(message).__name__}")
        return message

    def _gather_replies(self, method: str) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        for _ in range(self.world_size):
            reply = self._receive()
            if not isinstance(reply, WorkerReply) or reply.method != method:
                raise WorkerDiedError(f"unexpected message from a worker while waiting for {method!r}: {reply!r}")
            results[reply.rank] = reply.result
        return results

    def _receive(self, timeout_s: float | None = None) -> ModelRunnerOutput | WorkerReply:
        """The next message from the workers. timeout_s: the step watchdog (None: wait as long as
        the workers live, e.g. while they load the model)."""
        start = time.monotonic()
        while not self.result_socket.poll(POLL_MS if timeout_s is None else min(POLL_MS, int(timeout_s * 1000) + 1)):
            self.check_alive()
            waited = time.monotonic() - start
            if timeout_s is not None and waited >= timeout_s:
                self.hung = True
                raise WorkerHungError(
                    f"step watchdog: no answer from the workers after {waited:.1f} s (worker pids "
                    f"{self.worker_pids} still running but not answering: a hang, a stuck device or a stopped "
                    f"process); the engine shuts down. If steps legitimately take longer, raise "
                    f"--execute-model-timeout-seconds (now {timeout_s:g})."
                )
        message = worker_output_decoder.decode(self.result_socket.recv())
        if isinstance(message, WorkerReply) and message.error is not None:
            self._blame_dead_sibling(message.rank)
            raise WorkerDiedError(f"worker {message.rank} failed in {message.method}:\n{message.error}")
        return message

    def _blame_dead_sibling(self, reporter: int, grace_s: float = 1.0) -> None:
        """With several workers, one that dies makes its siblings' next collective fail; name the
        dead one (the cause) rather than the sibling that reported the broken collective."""
        deadline = time.monotonic() + (grace_s if self.world_size > 1 else 0.0)
        while True:
            for rank, proc in enumerate(self.procs):
                if rank != reporter and proc.poll() is not None:
                    raise WorkerDiedError(f"worker {rank} (pid {proc.pid}) exited unexpectedly with code "
                                          f"{proc.returncode}; worker {reporter} then lost it in a collective")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def check_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                raise WorkerDiedError(f"worker {rank} (pid {proc.pid}) exited unexpectedly with code {code}")

    def shutdown(self) -> None:
        payload = encode(Shutdown())
        for sock, proc in zip(self.work_sockets, self.procs):
            if proc.poll() is None:
                try:
                    sock.send(payload, flags=zmq.NOBLOCK)
                except zmq.Again:  # the worker never connected; stop_child ends it
                    pass
        # After a death the siblings may be stuck in a collective that never completes (NCCL waits
        # forever): give them a second to take the Shutdown, not the usual five.
        # A hung worker will not take it at all.
        timeout = 1.0 if self.hung or any(proc.poll() is not None for proc in self.procs) else 5.0
        for proc in self.procs:
            stop_child(proc, timeout=timeout)
        self.ctx.destroy(linger=0)
        for address in [self.result_address, *self.work_addresses]:
            remove_ipc_file(address)
