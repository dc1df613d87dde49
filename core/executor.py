"""The executors: they start the workers (one per GPU) and talk to them over channels
(protocol/channels.py: ordered msgspec bytes each way, never pickles).

Two ways to start and place the workers share one transport and its watchdogs (ChannelExecutor):
  - MpExecutor (distributed_executor_backend="mp", the default): local child processes, each
    reached through a Unix socket pair made for it (it inherits its end; nothing else can connect).
  - RayExecutor (core/ray_executor.py, "ray"): Ray actors placed by a placement group, possibly
    on other nodes. Ray only places and watches them; the steps still travel over ZMQ: a PUSH
    socket per worker for work and one shared PULL socket for the answers.
A third has no transport: UniProcExecutor (core/uniproc_executor.py, "uni") runs the one worker of
a single-device model inside the EngineCore process.
A SchedulerOutput is sent to every worker. Only one rank returns sampled tokens: rank 0, or with
pipeline parallelism TP rank 0 of the last stage (every TP rank samples the same ones: see
worker/models/parallel_layers.py; earlier stages only pass activations on: worker/pipeline.py).
World = pipeline_parallel_size x tensor_parallel_size ranks; rank = pp_rank * tp + tp_rank.
Ray's sockets are Unix sockets (ipc://) when every worker is on this host; when some are on other
nodes they are TCP on this node's address, and CURVE-authenticated with a key pair made for this
executor alone (only its workers hold it). With several workers (tensor or pipeline parallelism)
the executor also picks the address at which they form their torch.distributed group.
While waiting for an answer the executor checks every second that its workers are still alive
(a local worker's closed socket pair tells at once), so a dead worker becomes a WorkerDiedError
within about a second instead of a hang. A worker that hangs instead (a deadlock, a stuck device,
a stopped process) is caught by the step watchdog: a step unanswered after
config.execute_model_timeout_seconds becomes a WorkerHungError.
"""

from __future__ import annotations

import logging
import math
import secrets
import socket
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec
import zmq

from minivllm.protocol.auth import CurveKeys, start_client_key_authenticator
from minivllm.protocol.channels import Channel, ChannelClosed, StreamChannel, ZmqChannel, fd_address
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.ipc import (free_loopback_tcp_address, hand_over_stdin, new_ipc_address, remove_ipc_file,
                                   spawn_child, stop_child)
from minivllm.protocol.messages import (DeferredStart, ModelRunnerOutput, SchedulerOutput, Shutdown, WorkerCall,
                                        WorkerReply)
from minivllm.protocol.serial import encode, worker_output_decoder

if TYPE_CHECKING:
    from minivllm.core.uniproc_executor import UniProcExecutor

logger = logging.getLogger(__name__)

POLL_MS = 1000
# How long shutdown waits for the ZMQ context to terminate (_destroy_context).
CONTEXT_TERM_TIMEOUT_S = 5.0


def _destroy_context(ctx: zmq.Context, timeout: float) -> None:
    """ctx.destroy(linger=0), waited for at most `timeout` seconds. Terminating a context blocks
    until every socket in it is closed. Once, in the CPU suite, an executor's keyed TCP context never
    finished after its sockets and authenticator had closed; no cause was found. A context still
    terminating is left to a daemon thread, which the process's exit ends, and shutdown goes on."""
    thread = threading.Thread(target=ctx.destroy, kwargs={"linger": 0}, name="zmq-context-term", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        logger.warning("the executor's ZMQ context did not terminate within %.0f s; left to the process's exit",
                       timeout)


class WorkerDiedError(RuntimeError):
    """A worker process exited or reported a failure; the engine cannot go on."""


class WorkerHungError(WorkerDiedError):
    """The step watchdog fired: the workers did not answer a step in time."""


def make_executor(config: EngineConfig, prestarted: "PrestartedWorker | None" = None
                  ) -> "ChannelExecutor | UniProcExecutor":
    """The executor config.distributed_executor_backend names. prestarted: a worker started before
    the config existed, for MpExecutor's rank 0 (any other executor stops it)."""
    if prestarted is not None and config.distributed_executor_backend != "mp":
        prestarted.stop()
        prestarted = None
    if config.distributed_executor_backend == "ray":
        from minivllm.core.ray_executor import RayExecutor  # imports ray: only when asked for

        return RayExecutor(config)
    if config.distributed_executor_backend == "uni":
        from minivllm.core.uniproc_executor import UniProcExecutor  # imports torch: only when asked for

        return UniProcExecutor(config)
    return MpExecutor(config, prestarted)


class ChannelExecutor:
    """The transport and the watchdogs; subclasses start, watch and stop the workers.

    A subclass's constructor starts its workers and gives each its channels: socket pairs
    (open_socket_pairs(), MpExecutor), or ZMQ endpoints (bind_sockets() once it knows whether any
    worker is on another node; the addresses and curve_secret, if set, go to the workers). Then it
    waits for their "ready" with _gather_replies("ready").
    """

    # How long a sibling's death may take to show after a rank reported a broken collective.
    blame_grace_s = 1.0
    # How long a worker whose channel closed may take to show as exited.
    exit_grace_s = 2.0

    def __init__(self, config: EngineConfig) -> None:
        self.tensor_parallel_size = config.tensor_parallel_size
        self.pipeline_parallel_size = config.pipeline_parallel_size
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.output_rank = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        self.step_timeout_s = config.execute_model_timeout_seconds
        self.hung = False
        self.ctx = zmq.Context()
        self.authenticator = None
        self.curve_secret: str | None = None  # set when the sockets are TCP: the workers' key
        self.result_address = ""
        self.work_addresses: list[str] = []
        # Rank -> its work channel; the channels answers come in on (ZMQ: one shared socket;
        # socket pairs: the work channels themselves, which carry both ways).
        self.work_channels: list[Channel] = []
        self.result_channels: list[Channel] = []
        self.poller = zmq.Poller()

    # -- for subclasses -----------------------------------------------------------------------

    def bind_sockets(self, tcp_host: str | None = None) -> None:
        """Bind the result socket and one work socket per rank: Unix sockets (tcp_host None), or
        TCP on tcp_host with CURVE, for workers on other nodes."""
        if tcp_host is not None:
            self.curve_secret = secrets.token_hex(32)
            keys = CurveKeys(self.curve_secret)
            # ZAP: only a peer presenting this executor's client key finishes the CURVE handshake.
            self.authenticator = start_client_key_authenticator(self.ctx, keys.client_public, f"{__name__}.auth")
        sockets = [self.ctx.socket(zmq.PULL)] + [self.ctx.socket(zmq.PUSH) for _ in range(self.world_size)]
        addresses = []
        for i, sock in enumerate(sockets):
            if tcp_host is None:
                address = new_ipc_address("worker-results" if i == 0 else f"worker{i - 1}-in")
                sock.bind(address)
            else:
                keys.make_server(sock)
                port = sock.bind_to_random_port(f"tcp://{_bracket(tcp_host)}")
                address = f"tcp://{_bracket(tcp_host)}:{port}"
            addresses.append(address)
        self.result_address, self.work_addresses = addresses[0], addresses[1:]
        self._use_channels([ZmqChannel(sock) for sock in sockets[1:]], [ZmqChannel(sockets[0])])

    def open_socket_pairs(self, first: socket.socket | None = None) -> list[socket.socket]:
        """A Unix socket pair per rank, for workers on this host: returns the workers' ends, one
        per rank, for the subclass to hand down (as file descriptors, under fd_address()) and
        then close here, so that a worker's exit shows as the end of its channel. first: our end
        of rank 0's pair, made already (a prestarted worker's); its place in the list is None."""
        num_new = self.world_size - (first is not None)
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(num_new)]
        if first is not None:
            pairs.insert(0, (first, None))
        channels = [StreamChannel(ours) for ours, _ in pairs]
        self._use_channels(channels, channels)
        return [theirs for _, theirs in pairs]

    def _use_channels(self, work_channels: list[Channel], result_channels: list[Channel]) -> None:
        self.work_channels, self.result_channels = work_channels, result_channels
        for channel in result_channels:
            self.poller.register(channel.pollable, zmq.POLLIN)

    def stage_note(self, rank: int) -> str:
        """", pipeline stage 1" (and ", TP rank 1") for a worker's description; "" without PP."""
        if self.pipeline_parallel_size == 1:
            return ""
        tp_note = f", TP rank {rank % self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        return f", pipeline stage {rank // self.tensor_parallel_size}{tp_note}"

    def dead_worker(self, rank: int) -> str | None:
        """Why worker `rank` is gone (for the error), or None while it lives."""
        raise NotImplementedError

    def describe_workers(self) -> str:
        """The workers, for a message ("pids [...]", "Ray actors on ...")."""
        raise NotImplementedError

    def stop_workers(self, timeout: float) -> None:
        """Wait up to `timeout` for the workers to take the Shutdown sent them, then end them."""
        raise NotImplementedError

    @property
    def worker_pids(self) -> list[int]:
        raise NotImplementedError

    # -- the engine's interface ---------------------------------------------------------------

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call Worker.<method>(*args) on every worker; return their results by rank."""
        self._send_to_all(encode(WorkerCall(method, list(args))))
        return self._gather_replies(method)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.receive_output()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Send a step to every worker without waiting (they queue steps and run them in order;
        what a socket pair does not take at once goes out while the executor waits for answers)."""
        self._send_to_all(encode(scheduler_output))

    def receive_output(self) -> ModelRunnerOutput:
        """The sampled tokens of the oldest step submitted and not yet received."""
        message = self._receive(self.step_timeout_s)
        if not isinstance(message, ModelRunnerOutput):
            raise WorkerDiedError(f"expected a model output from rank {self.output_rank}, got "
                                  f"{type(message).__name__}")
        return message

    def check_alive(self) -> None:
        for rank in range(self.world_size):
            reason = self.dead_worker(rank)
            if reason is not None:
                raise WorkerDiedError(reason)

    def shutdown(self) -> None:
        payload = encode(Shutdown())
        any_dead = False
        for rank, channel in enumerate(self.work_channels):
            if self.dead_worker(rank) is None:
                try:  # (a worker that cannot take it now: stop_workers ends it)
                    channel.send_nowait(payload)
                except ChannelClosed:
                    pass
            else:
                any_dead = True
        # After a death the siblings may be stuck in a collective that never completes (NCCL waits
        # forever): give them a second to take the Shutdown, not the usual five.
        # A hung worker will not take it at all.
        self.stop_workers(timeout=1.0 if self.hung or any_dead else 5.0)
        # The sockets close before the authenticator stops, so that no CURVE handshake still in
        # progress waits on a ZAP handler that is gone.
        for channel in {*self.work_channels, *self.result_channels}:
            channel.close()
        if self.authenticator is not None:
            self.authenticator.stop()
        _destroy_context(self.ctx, CONTEXT_TERM_TIMEOUT_S)
        for address in [self.result_address, *self.work_addresses]:
            remove_ipc_file(address)

    # -- plumbing -----------------------------------------------------------------------------

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
        poll_ms = POLL_MS if timeout_s is None else min(POLL_MS, int(timeout_s * 1000) + 1)
        while (channel := self._poll(poll_ms)) is None:
            self.check_alive()
            waited = time.monotonic() - start
            if timeout_s is not None and waited >= timeout_s:
                self.hung = True
                raise WorkerHungError(
                    f"step watchdog: no answer from the workers after {waited:.1f} s ({self.describe_workers()} "
                    f"still running but not answering: a hang, a stuck device or a stopped process); the engine "
                    f"shuts down. If steps legitimately take longer, raise --execute-model-timeout-seconds "
                    f"(now {timeout_s:g})."
                )
        try:
            message = worker_output_decoder.decode(channel.recv())
        except ChannelClosed:
            self._worker_gone(channel)
        if isinstance(message, WorkerReply) and message.error is not None:
            self._blame_dead_sibling(message.rank)
            raise WorkerDiedError(f"worker {message.rank} failed in {message.method}:\n{message.error}")
        return message

    def _send_to_all(self, payload: bytes) -> None:
        for channel in self.work_channels:
            try:
                channel.send(payload)
            except ChannelClosed:
                self._worker_gone(channel)

    def _worker_gone(self, channel: Channel) -> NoReturn:
        """A local worker's socket pair closed: its process is exiting. Name that worker (the
        rank of the channel; not a sibling that may exit after it) once it shows as exited."""
        rank = self.work_channels.index(channel)
        deadline = time.monotonic() + self.exit_grace_s
        while (reason := self.dead_worker(rank)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        raise WorkerDiedError(reason or f"worker {rank} closed its channel but has not exited "
                                        f"({self.describe_workers()})")

    def _poll(self, timeout_ms: int) -> Channel | None:
        """A result channel with a message to read, waiting up to timeout_ms; meanwhile steps
        still in a socket pair's outbox go out as the worker takes them."""
        unsent = [channel for channel in self.work_channels if channel.has_unsent]
        for channel in unsent:
            self.poller.modify(channel.pollable, zmq.POLLIN | zmq.POLLOUT)
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            events = dict(self.poller.poll(max(0, math.ceil((deadline - time.monotonic()) * 1000))))
            for channel in unsent:
                try:
                    if events.get(channel.pollable, 0) & zmq.POLLOUT and channel.flush():
                        self.poller.modify(channel.pollable, zmq.POLLIN)
                except ChannelClosed:
                    self._worker_gone(channel)
            unsent = [channel for channel in unsent if channel.has_unsent]
            for channel in self.result_channels:
                if events.get(channel.pollable, 0) & zmq.POLLIN:
                    return channel
            if time.monotonic() >= deadline:
                return None

    def _blame_dead_sibling(self, reporter: int) -> None:
        """With several workers, one that dies makes its siblings' next collective fail; name the
        dead one (the cause) rather than the sibling that reported the broken collective."""
        deadline = time.monotonic() + (self.blame_grace_s if self.world_size > 1 else 0.0)
        while True:
            for rank in range(self.world_size):
                if rank != reporter and (reason := self.dead_worker(rank)) is not None:
                    raise WorkerDiedError(f"{reason}; worker {reporter} then lost it in a collective")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)


class PrestartedWorker:
    """Worker rank 0, started before its engine has a config (`minivllm.core.engine_core
    --config-stdin`, which the frontends start before they resolve theirs): it imports torch and the
    model code meanwhile, ~2-3 s of a start that otherwise follow the frontend's own ~3-4 s of
    importing transformers and reading the model's config. It then waits on its stdin for the
    config (worker.read_deferred_start); MpExecutor takes it as rank 0, or it is stopped unused."""

    def __init__(self) -> None:
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        address = fd_address(theirs.fileno())
        try:
            self.proc = spawn_child(
                "minivllm.worker.worker",
                ["--config-stdin", "--rank", "0", "--work-address", address, "--result-address", address],
                pass_fds=(theirs.fileno(),), stdin=subprocess.PIPE,
            )
        finally:
            theirs.close()

    def start(self, config: EngineConfig, dist_init_address: str | None) -> None:
        # (if it died, the wait for its "ready" reports that)
        hand_over_stdin(self.proc, msgspec.json.encode(DeferredStart(config, dist_init_address)))

    def stop(self) -> None:
        """Unused: nothing of it needs an orderly end (it may still be importing)."""
        hand_over_stdin(self.proc, b"")
        self.ours.close()
        self.proc.kill()
        self.proc.wait()


class MpExecutor(ChannelExecutor):
    """The workers are child processes of the EngineCore, on this host. prestarted: rank 0, already
    started (PrestartedWorker)."""

    def __init__(self, config: EngineConfig, prestarted: PrestartedWorker | None = None) -> None:
        super().__init__(config)
        config_json = msgspec.json.encode(config).decode()
        dist_init_address = free_loopback_tcp_address() if self.world_size > 1 else None
        dist_args = ["--dist-init-address", dist_init_address] if dist_init_address is not None else []
        self.procs: list[subprocess.Popen] = []
        for rank, worker_end in enumerate(self.open_socket_pairs(prestarted.ours if prestarted else None)):
            if worker_end is None:  # rank 0, prestarted
                prestarted.start(config, dist_init_address)
                self.procs.append(prestarted.proc)
                continue
            address = fd_address(worker_end.fileno())  # (the child inherits it under the same number)
            self.procs.append(spawn_child(
                "minivllm.worker.worker",
                ["--config", config_json, "--rank", str(rank), "--work-address", address, "--result-address", address,
                 *dist_args],
                pass_fds=(worker_end.fileno(),),
            ))
            worker_end.close()
        # Each worker says "ready" once its model is loaded (or reports why it could not).
        self._gather_replies("ready")
        logger.info("%d worker(s) ready (pids %s)", self.world_size, self.worker_pids)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def dead_worker(self, rank: int) -> str | None:
        proc = self.procs[rank]
        code = proc.poll()
        if code is None:
            return None
        return f"worker {rank} (pid {proc.pid}{self.stage_note(rank)}) exited unexpectedly with code {code}"

    def describe_workers(self) -> str:
        return f"worker pids {self.worker_pids}"

    def stop_workers(self, timeout: float) -> None:
        for proc in self.procs:
            stop_child(proc, timeout=timeout)


# The name the engine used before there were two backends.
Executor = MpExecutor


def _bracket(host: str) -> str:
    """An IPv6 address in brackets, as a tcp:// address needs it."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
