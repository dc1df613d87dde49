"""The frontend's line to the EngineCore: a ZMQ DEALER socket, msgpack messages.

The client either spawns an EngineCore process (at a fresh ipc:// address) or attaches to one
started with `minivllm engine` (any address). A dead engine turns into EngineDeadError:
  - the spawned process exited,
  - the engine said so (a worker died), or
  - the connection dropped (ZMQ heartbeats notice a silent peer within seconds).
Request ids get a per-client prefix on the wire, so frontends sharing one engine never collide.
An engine started with a key (`minivllm engine --engine-key-file`) accepts only clients holding
the same key (engine_key=, or MINIVLLM_ENGINE_KEY): ZMQ CURVE, see protocol/auth.py. A failed
handshake (no key, wrong key) is a clear ConnectionError, not a hang. A request the engine
refuses comes back with an error (request_error): ValueError or EngineOverloadedError.

With data_parallel_size > 1, spawn() starts that many engines behind one client that balances
requests over them (frontend/dp_client.py).

Two transports share EngineCoreClientBase: EngineCoreClient (blocking, for LLM) and
AsyncEngineCoreClient (asyncio, for AsyncLLM: one background task owns its socket and routes
outputs to per-request queues; it starts and stops the engine through an EngineCoreClient).

Threads (blocking client): a ZMQ socket is one thread's at a time, and generate() holds this
client's socket while it waits for outputs. So an abort or a utility call (stats, ...) made while another thread
holds it goes through a second connection to the engine (made on first need). The engine
routes each request's outputs to the connection that added it, so nothing is lost; an abort
sent through the second connection right after the add may overtake it, and is then ignored.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message, recv_monitor_message

from minivllm.protocol.auth import ENGINE_KEY_ENV, HANDSHAKE_FAILED_EVENTS, HANDSHAKE_FAILURES, CurveKeys, resolve_engine_key
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.ipc import hand_over_stdin, new_ipc_address, remove_ipc_file, spawn_child, stop_child
from minivllm.protocol.messages import (
    AbortRequests,
    AddRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    ERROR_OVERLOADED,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from minivllm.protocol.serial import encode, engine_output_decoder
from minivllm.protocol.validation import EngineLimits

logger = logging.getLogger(__name__)

POLL_MS = 500


class EngineDeadError(RuntimeError):
    """The EngineCore (or one of its workers) is gone; this engine can serve no more requests."""


class KVTransferError(RuntimeError):
    """The request's KV could not be loaded from another instance (prefill/decode disaggregation)."""


class EngineOverloadedError(RuntimeError):
    """The engine holds as many requests as it may (max_pending_requests) and refused this one;
    try again later. Other requests are unaffected."""


def request_error(out: EngineCoreOutput) -> Exception | None:
    """The error to raise for a request the engine refused (None if it did not): ValueError for
    invalid values (the engine's message says which and the allowed range), EngineOverloadedError
    when the engine held max_pending_requests already."""
    if out.error_type is None:
        return None
    message = out.error or "the engine refused the request"
    if out.error_type == ERROR_OVERLOADED:
        return EngineOverloadedError(message)
    if out.error_type == "kv_transfer":  # messages.ERROR_KV_TRANSFER: its KV never arrived (not the client's fault)
        return KVTransferError(message)
    return ValueError(message)




def spawn_engine_process(config: EngineConfig, name: str = "engine",
                         env: dict[str, str] | None = None) -> tuple[str, subprocess.Popen]:
    """Start an EngineCore process serving at a fresh ipc:// address; returns (address, process)."""
    address = new_ipc_address(name)
    proc = spawn_child("minivllm.core.engine_core", ["--config", msgspec.json.encode(config).decode(),
                                                     "--address", address], env=env)
    return address, proc


# $MINIVLLM_PRESTART_ENGINE=0: start the engine only once its config is resolved (for measuring).
PRESTART_ENGINE = os.environ.get("MINIVLLM_PRESTART_ENGINE", "1") != "0"


class PendingEngine:
    """An EngineCore process started before its config exists (engine_core's --config-stdin). It
    starts its worker rank 0 at once, which imports torch and the model code (~2-3 s) while this
    process imports transformers and resolves the config (~3-4 s: transformers imports torch too),
    instead of after. start() hands it the config; cancel() stops both."""

    def __init__(self, name: str = "engine") -> None:
        self.address = new_ipc_address(name)
        self.proc = spawn_child("minivllm.core.engine_core", ["--config-stdin", "--address", self.address],
                                stdin=subprocess.PIPE)

    def start(self, config: EngineConfig) -> tuple[str, subprocess.Popen]:
        """Send the config; returns (address, process), as spawn_engine_process does (if it died
        already, wait_ready says so)."""
        hand_over_stdin(self.proc, msgspec.json.encode(config))
        return self.address, self.proc

    def cancel(self) -> None:
        """An empty config: it stops its worker and exits."""
        hand_over_stdin(self.proc, b"")
        stop_child(self.proc)
        remove_ipc_file(self.address)


def config_beside_engine(make_config: Callable[[], EngineConfig], engine_args: dict[str, Any]
                         ) -> tuple[EngineConfig, PendingEngine | None]:
    """make_config() (EngineConfig.create: transformers' import and the model's config) while an
    EngineCore and its first worker start beside it (PendingEngine), where one engine of local
    workers is asked for (no data parallelism, the "mp" backend). Returns the config and that
    engine, for EngineCoreClient.spawn; a config that fails stops the engine and raises."""
    backend = engine_args.get("distributed_executor_backend") or "mp"
    pending = None
    if PRESTART_ENGINE and backend == "mp" and (engine_args.get("data_parallel_size") or 1) == 1:
        pending = PendingEngine()
    try:
        return make_config(), pending
    except BaseException:
        if pending is not None:
            pending.cancel()
        raise


class EngineCoreClientBase:
    """What every transport to the EngineCore shares: the engine process (if spawned), the
    per-client request-id prefix, how the engine's messages are read, and when it counts as dead.
    Subclasses own the socket and say where outputs and utility results go."""

    def __init__(self, address: str, proc: subprocess.Popen | None = None, owns_engine: bool = True,
                 engine_key: str | None = None) -> None:
        self.address = address
        self.engine_key = engine_key
        self.curve_keys = CurveKeys(engine_key) if engine_key is not None else None
        self.proc = proc  # set when the engine was spawned (by this client, or the one it serves)
        self.owns_engine = proc is not None and owns_engine  # stop it at shutdown
        self.dead_reason: str | None = None
        self.connected = False
        self.prefix = uuid.uuid4().hex[:8] + "-"
        self.call_ids = itertools.count()
        self.live_request_ids: set[str] = set()
        self.engine_info: EngineInfo | None = None
        self.label = ""  # which engine, in a dead engine's reason (data parallelism: "engine core 1: ")

    def _connect(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
        """A DEALER socket to the engine, and its monitor socket (connection events)."""
        socket = ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        # ZMTP heartbeats: a peer that stops answering is dropped, which the monitor reports.
        socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        if self.curve_keys is not None:
            self.curve_keys.make_client(socket)
        monitor = socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED_EVENTS)
        socket.connect(self.address)
        return socket, monitor

    def _on_message(self, message: EngineCoreOutputs) -> None:
        if message.engine_dead is not None:
            self._mark_dead(f"the engine failed: {message.engine_dead}")
        if message.utility_result is not None:
            self._on_utility_result(message.utility_result)
        for out in message.outputs:
            out.request_id = out.request_id[len(self.prefix):]
            if out.finish_reason is not None:
                self._forget_request(out.request_id)
            self._on_output(out)

    def _on_utility_result(self, result: UtilityResult) -> None:
        raise NotImplementedError

    def _on_output(self, out: EngineCoreOutput) -> None:
        raise NotImplementedError

    def _forget_request(self, request_id: str) -> None:
        self.live_request_ids.discard(request_id)

    def _on_monitor_event(self, event: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
        elif event == zmq.EVENT_DISCONNECTED and self.connected:
            if self.proc is not None:  # a spawned engine that died: its exit says more than the socket
                try:
                    self.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
                self._check_alive()
            self._mark_dead(f"lost the connection to the EngineCore at {self.address}")
        elif event in HANDSHAKE_FAILURES:
            keyed = "with an engine key" if self.curve_keys is not None else "without an engine key"
            self._mark_dead(
                f"could not authenticate with the engine at {self.address} ({HANDSHAKE_FAILURES[event]}; this "
                f"client connects {keyed}): give the engine's key with engine_key=... or {ENGINE_KEY_ENV} "
                "(the content of the engine's --engine-key-file).")

    def _check_alive(self) -> None:
        if self.dead_reason is None and self.proc is not None and self.proc.poll() is not None:
            self._mark_dead(f"the EngineCore process (pid {self.proc.pid}) exited with code {self.proc.returncode}")
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = self.label + reason
            logger.error("engine dead: %s", self.dead_reason)
        raise EngineDeadError(self.label + reason)


class EngineCoreClient(EngineCoreClientBase):
    """The blocking transport, for LLM: whichever thread calls in drives the socket."""

    def __init__(self, address: str, proc: subprocess.Popen | None = None, owns_engine: bool = True,
                 engine_key: str | None = None) -> None:
        super().__init__(address, proc, owns_engine, engine_key)
        self.ctx = zmq.Context()
        self.socket, self.monitor = self._connect(self.ctx)
        self.utility_results: dict[int, UtilityResult] = {}
        self.pending_outputs: list[EngineCoreOutput] = []
        # Whoever holds io_lock owns the socket; see the module docstring for the others.
        self.io_lock = threading.Lock()
        self.ids_lock = threading.Lock()  # live_request_ids is read from other threads
        self.side_lock = threading.Lock()
        self.side_client: EngineCoreClient | None = None

    # -- starting -------------------------------------------------------------------------------

    @classmethod
    def spawn(cls, config: EngineConfig, pending: PendingEngine | None = None) -> "EngineCoreClient":
        """Start an EngineCore process for `config` and wait until it serves. With
        data_parallel_size > 1: that many, behind one DPEngineCoreClient (frontend/dp_client.py).
        pending: an engine started already (config_beside_engine), which takes the config."""
        if config.data_parallel_size > 1:
            from minivllm.frontend.dp_client import DPEngineCoreClient

            if pending is not None:
                pending.cancel()
            return DPEngineCoreClient.spawn(config)  # type: ignore[return-value]
        address, proc = pending.start(config) if pending is not None else spawn_engine_process(config)
        client = cls(address, proc)
        client.wait_ready()
        return client

    def wait_ready(self) -> None:
        """Wait for a spawned engine to serve (loading a model takes as long as it takes; a crash
        is noticed through proc.poll()); stop it and raise if it failed to start."""
        try:
            self.engine_info = self.call_utility("get_engine_info", type=EngineInfo)
        except EngineDeadError as e:
            self.shutdown()
            raise RuntimeError(f"the EngineCore failed to start ({e}); its log above says why") from None

    @classmethod
    def attach(cls, address: str, timeout: float = 60.0, engine_key: str | None = None) -> "EngineCoreClient":
        """Connect to an EngineCore started elsewhere (`minivllm engine --address ...`).
        engine_key: the engine's secret (default: $MINIVLLM_ENGINE_KEY, if set)."""
        client = cls(address, engine_key=resolve_engine_key(key=engine_key))
        try:
            client.engine_info = client.call_utility("get_engine_info", type=EngineInfo, timeout=timeout)
        except TimeoutError:
            client.shutdown()
            raise ConnectionError(f"no minivllm engine answered at {address} within {timeout:.0f} s") from None
        except EngineDeadError as e:  # e.g. the handshake failed: a wrong or missing key
            client.shutdown()
            raise ConnectionError(str(e)) from None
        return client

    # -- requests -------------------------------------------------------------------------------

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Send requests together: one alone as itself, several as one AddRequests message, whose
        steps in the engine are those of the whole batch, whatever the timing. (A
        batch over the largest message the engine takes is split in halves, each sent whole.)"""
        wire = [msgspec.structs.replace(r, request_id=self.prefix + r.request_id) for r in requests]
        with self.io_lock:
            self._check_alive()
            if len(wire) == 1:
                self._send(wire[0])
            else:
                info = self.engine_info
                self._send_batch(wire, EngineLimits.from_engine_info(info).max_message_bytes if info else 1 << 20)
        with self.ids_lock:  # abortable only once sent, so an abort never precedes its add here
            self.live_request_ids.update(r.request_id for r in requests)

    def _send_batch(self, requests: list[EngineCoreRequest], limit: int) -> None:
        data = encode(AddRequests(requests))
        if len(data) > limit and len(requests) > 1:
            half = len(requests) // 2
            self._send_batch(requests[:half], limit)
            self._send_batch(requests[half:], limit)
        else:
            self._send(data)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort these of this client's requests (others are ignored). Any thread may call it."""
        with self.ids_lock:
            ids = [i for i in request_ids if i in self.live_request_ids]
        if not ids or self.dead_reason is not None:
            return
        message = AbortRequests([self.prefix + i for i in ids])
        if self.io_lock.acquire(blocking=False):
            try:
                self._send(message)
            finally:
                self.io_lock.release()
        else:
            with self.side_lock:
                self._side_client()._send(message)

    def get_unfinished_request_ids(self) -> list[str]:
        with self.ids_lock:
            return list(self.live_request_ids)

    def get_outputs(self, timeout: float | None = None) -> list[EngineCoreOutput]:
        """The outputs that arrived; waits up to `timeout` seconds (None: until some arrive)."""
        with self.io_lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self.pending_outputs:
                if not self._receive(deadline):
                    break
            outputs, self.pending_outputs = self.pending_outputs, []
            return outputs

    def call_utility(self, method: str, *args: Any, type: Any = Any, timeout: float | None = None) -> Any:
        """Run EngineCore.<method>(*args) in the engine's busy loop and return its result.
        Any thread may call it."""
        if not self.io_lock.acquire(blocking=False):
            with self.side_lock:
                return self._side_client().call_utility(method, *args, type=type, timeout=timeout)
        try:
            return self._call_utility(method, args, type, timeout)
        finally:
            self.io_lock.release()

    def _side_client(self) -> "EngineCoreClient":
        """The second connection, for calls while another thread holds the socket (hold side_lock)."""
        self._check_alive()
        if self.side_client is None:
            self.side_client = EngineCoreClient(self.address, self.proc, owns_engine=False, engine_key=self.engine_key)
        return self.side_client

    def _call_utility(self, method: str, args: tuple, type: Any, timeout: float | None) -> Any:
        self._check_alive()
        call_id = next(self.call_ids)
        self._send(UtilityCall(call_id, method, list(args)))
        deadline = None if timeout is None else time.monotonic() + timeout
        while call_id not in self.utility_results:
            if not self._receive(deadline):
                raise TimeoutError(f"the engine did not answer {method!r} within {timeout} s")
        result = self.utility_results.pop(call_id)
        if result.error is not None:
            raise RuntimeError(f"engine utility {method!r} failed: {result.error}")
        return msgspec.convert(result.result, type)

    # -- plumbing -------------------------------------------------------------------------------

    def _send(self, message: Any) -> None:
        """Send, waiting for room while watching the connection events. A DEALER blocks a send
        while it has no connection to queue on, and after a refused handshake (a wrong or missing
        key) it never gets one: a plain blocking send would hang where the monitor says why.
        (`message` may be encoded already.)"""
        data = message if isinstance(message, bytes) else encode(message)
        poller = None
        while True:
            try:
                # Copied into ZMQ's own buffer: a zero-copy send of a large message starts pyzmq's
                # garbage-collector thread the first time (2-4 ms before a 256-prompt batch's first
                # step) and costs more than the copy every time after (~0.1 ms for 0.7 MB).
                self.socket.send(data, flags=zmq.NOBLOCK, copy=True)
                return
            except zmq.Again:
                pass
            if poller is None:
                poller = zmq.Poller()
                poller.register(self.socket, zmq.POLLOUT)
                poller.register(self.monitor, zmq.POLLIN)
            self._check_alive()
            events = dict(poller.poll(POLL_MS))
            if self.monitor in events:
                self._on_monitor_event(recv_monitor_message(self.monitor)["event"])

    def _receive(self, deadline: float | None) -> bool:
        """Wait for one message (until `deadline`); False on time-out. Raises EngineDeadError."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            self._check_alive()
            wait_ms = POLL_MS if deadline is None else min(POLL_MS, max(0, int((deadline - time.monotonic()) * 1000)))
            events = dict(poller.poll(wait_ms))
            # Messages before connection events: a dying engine's last message says why it died,
            # and its disconnect may be readable at the same moment.
            if self.socket in events:
                self._on_message(engine_output_decoder.decode(self.socket.recv()))
                return True
            if self.monitor in events:
                self._on_monitor_event(recv_monitor_message(self.monitor)["event"])
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _on_utility_result(self, result: UtilityResult) -> None:
        self.utility_results[result.call_id] = result

    def _on_output(self, out: EngineCoreOutput) -> None:
        self.pending_outputs.append(out)

    def _forget_request(self, request_id: str) -> None:
        with self.ids_lock:
            self.live_request_ids.discard(request_id)

    def shutdown(self) -> None:
        """Stop a spawned engine; for an attached one, abort this client's requests and detach."""
        if self.ctx.closed:
            return
        try:
            if self.side_client is not None:
                self.side_client.shutdown()
            if self.dead_reason is None:
                if self.owns_engine:
                    self._send(Shutdown())
                elif self.live_request_ids:
                    self.abort_requests(list(self.live_request_ids))  # linger lets it leave
        finally:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
            self.socket.close(linger=1000)
            self.ctx.term()
            if self.owns_engine:
                stop_child(self.proc, timeout=10.0)
                remove_ipc_file(self.address)


class AsyncEngineCoreClient(EngineCoreClientBase):
    """The asyncio transport, for AsyncLLM: one background task owns the socket, decodes what the
    engine sends and routes each request's outputs to that request's asyncio.Queue.

    The engine is started (or attached to) through a blocking EngineCoreClient, kept as the
    control connection: AsyncLLM() is built outside any event loop, as vLLM's is, and shutdown
    must work after the loop is gone. The async socket and its task belong to one event loop;
    a later loop (a second asyncio.run) gets a fresh pair.
    """

    def __init__(self, control: EngineCoreClient) -> None:
        super().__init__(control.address, control.proc, control.owns_engine, control.engine_key)
        self.control = control
        self.engine_info = control.engine_info
        self.label = control.label
        self.ctx = zmq.asyncio.Context()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.socket: zmq.asyncio.Socket | None = None
        self.monitor: zmq.asyncio.Socket | None = None
        self.output_task: asyncio.Task | None = None
        # A queue gets EngineCoreOutputs, then EngineDeadError if the engine dies first.
        self.streams: dict[str, asyncio.Queue[EngineCoreOutput | EngineDeadError]] = {}
        self.utility_futures: dict[int, asyncio.Future[UtilityResult]] = {}

    @classmethod
    def spawn(cls, config: EngineConfig, pending: PendingEngine | None = None) -> "AsyncEngineCoreClient":
        if config.data_parallel_size > 1:
            from minivllm.frontend.dp_client import DPAsyncEngineCoreClient

            if pending is not None:
                pending.cancel()
            return DPAsyncEngineCoreClient.spawn(config)  # type: ignore[return-value]
        return cls(EngineCoreClient.spawn(config, pending))

    @classmethod
    def attach(cls, address: str, timeout: float = 60.0, engine_key: str | None = None) -> "AsyncEngineCoreClient":
        return cls(EngineCoreClient.attach(address, timeout, engine_key=engine_key))

    # -- requests -------------------------------------------------------------------------------

    async def add_request(
        self, request: EngineCoreRequest, stream: asyncio.Queue[EngineCoreOutput | EngineDeadError] | None = None
    ) -> asyncio.Queue[EngineCoreOutput | EngineDeadError]:
        """Send the request; its outputs arrive in the returned queue, the last one finished.
        Several requests may share one queue (`stream`: the n completions of one prompt)."""
        self._ensure_connected()
        if request.request_id in self.streams:
            raise ValueError(f"request id {request.request_id!r} is already running; give each live request its own id.")
        if stream is None:
            stream = asyncio.Queue()
        self.streams[request.request_id] = stream
        self.live_request_ids.add(request.request_id)
        try:
            await self.socket.send(encode(msgspec.structs.replace(request, request_id=self.prefix + request.request_id)))
        except BaseException:
            self.streams.pop(request.request_id, None)
            self.live_request_ids.discard(request.request_id)
            raise
        return stream

    def abort_requests(self, request_ids: list[str], drop_streams: bool = False) -> None:
        """Abort these of this client's requests (others are ignored). Not a coroutine, so that a
        cancelled or closed stream can abort on its way out. Their streams get the engine's final
        "abort" output, or nothing more when `drop_streams`."""
        ids = [i for i in request_ids if i in self.live_request_ids]
        if drop_streams:
            for request_id in request_ids:
                self.streams.pop(request_id, None)
        if not ids or self.dead_reason is not None or self.socket is None or self.socket.closed:
            return
        # zmq.asyncio sends at once when it can (a DEALER's queue is rarely full); the future
        # only matters if it could not, so nobody needs to await it.
        future = self.socket.send(encode(AbortRequests([self.prefix + i for i in ids])))
        future.add_done_callback(_log_send_failure)
        if drop_streams:  # nobody waits for the engine's "abort" output: forget them now
            self.live_request_ids.difference_update(ids)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.streams

    def get_unfinished_request_ids(self) -> list[str]:
        return list(self.live_request_ids)

    async def call_utility(self, method: str, *args: Any, type: Any = Any) -> Any:
        """Run EngineCore.<method>(*args) in the engine's busy loop and return its result."""
        self._ensure_connected()
        call_id = next(self.call_ids)
        future: asyncio.Future[UtilityResult] = self.loop.create_future()
        self.utility_futures[call_id] = future
        try:
            await self.socket.send(encode(UtilityCall(call_id, method, list(args))))
            result = await future
        finally:
            self.utility_futures.pop(call_id, None)
        if result.error is not None:
            raise RuntimeError(f"engine utility {method!r} failed: {result.error}")
        return msgspec.convert(result.result, type)

    # -- the output task ------------------------------------------------------------------------

    def _ensure_connected(self) -> None:
        """Connect from the running event loop (and start its output task) unless done already."""
        loop = asyncio.get_running_loop()
        if self.loop is loop and self.output_task is not None and not self.output_task.done():
            return
        self._check_alive()
        self._close_socket()  # one made by an earlier event loop, unusable from this one
        self.loop = loop
        self.socket, self.monitor = self._connect(self.ctx)
        self.output_task = loop.create_task(self._run_output_loop(), name="minivllm-engine-outputs")

    async def _run_output_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        try:
            while True:
                self._check_alive()  # notices a spawned engine's exit within POLL_MS
                events = dict(await poller.poll(POLL_MS))
                # Everything that arrived, before polling again; messages before connection events
                # (a dying engine's last message says why it died).
                while self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._on_message(engine_output_decoder.decode(await self.socket.recv()))
                if self.monitor in events:
                    self._on_monitor_event(parse_monitor_message(await self.monitor.recv_multipart())["event"])
        except EngineDeadError as e:
            self._fail_everything(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave streams waiting forever
            logger.exception("the engine output handler failed")
            self.dead_reason = self.dead_reason or f"the engine output handler failed: {e!r}"
            self._fail_everything(EngineDeadError(self.dead_reason))

    def _on_utility_result(self, result: UtilityResult) -> None:
        future = self.utility_futures.get(result.call_id)
        if future is not None and not future.done():
            future.set_result(result)

    def _on_output(self, out: EngineCoreOutput) -> None:
        stream = self.streams.get(out.request_id)
        if stream is None:  # cancelled here already
            return
        stream.put_nowait(out)
        if out.finish_reason is not None:
            del self.streams[out.request_id]

    def _fail_everything(self, error: EngineDeadError) -> None:
        for stream in self.streams.values():
            stream.put_nowait(error)
        self.streams.clear()
        self.live_request_ids.clear()
        for future in self.utility_futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(str(error)))

    def _close_socket(self) -> None:
        task = self.output_task
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.cancel()
        if self.socket is not None:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
            self.socket.close(linger=0)
        self.socket = self.monitor = self.output_task = None
        self.connected = False

    def shutdown(self, stop_engine: bool = True) -> None:
        """Stop a spawned engine; for an attached one, abort this client's requests and detach.
        Not a coroutine: it works with or without a running event loop. stop_engine=False leaves
        the control connection (and the engine) to the caller."""
        if self.ctx.closed:
            return
        try:
            if self.live_request_ids and self.dead_reason is None and self.control.dead_reason is None:
                # Through the control connection: this loop may be gone, and it lingers to deliver.
                self.control._send(AbortRequests([self.prefix + i for i in self.live_request_ids]))
            if self.dead_reason is not None and self.control.dead_reason is None:
                self.control.dead_reason = self.dead_reason  # no Shutdown to a dead engine
            error = EngineDeadError("the engine was shut down")
            for stream in self.streams.values():
                stream.put_nowait(error)
            self.streams.clear()
        finally:
            self._close_socket()
            self.ctx.destroy(linger=0)
            if stop_engine:
                self.control.shutdown()


def _log_send_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("could not send an abort to the engine: %s", future.exception())
