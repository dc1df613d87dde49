"""Moving one request's KV blocks between two instances over ZMQ/TCP as raw buffer frames.

Producer (prefill instance), one KVBlockServer thread per worker rank, bound at kv_ip:kv_port+rank:
a finished prompt's blocks are `hold()`-ed (the scheduler delays freeing them); a consumer's
PullRequest is answered with one message per layer, [header, K bytes, V bytes] (the blocks gathered
into one contiguous host buffer, sent without a copy or any pickling), then the blocks are
released. Blocks nobody pulls within hold_timeout_s are released too, so a vanished consumer
cannot pin the cache.

Consumer (decode instance), one KVBlockPuller thread per worker rank: pulls a request's blocks from
the same rank of the producer and scatters each layer into the freshly allocated local blocks as
it arrives (the producer keeps sending the next layers meanwhile: transfer and copy overlap, and
the model keeps running other requests on the main thread). A producer silent for timeout_s fails
the request with a clear error.

Only plain data crosses the socket: msgspec headers and raw tensor bytes.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import torch
import zmq

logger = logging.getLogger(__name__)

# uint8: an FP8 cache's packed blocks (worker/attention/kv_cache.py); both ends must use it then,
# which the shape check below enforces (a packed block is one row of bytes).
_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.uint8)}


class PullRequest(msgspec.Struct, tag="pull"):
    req_id: str  # the producer's request id (from kv_transfer_params)
    block_ids: list[int]  # the producer's blocks, as its kv_transfer_params named them


class LayerHeader(msgspec.Struct, tag="layer"):
    req_id: str
    layer: int
    num_layers: int
    dtype: str
    shape: list[int]  # of K (and of V): [num_blocks, block_size, num_kv_heads, head_dim]


class PullError(msgspec.Struct, tag="error"):
    req_id: str
    error: str


_encode = msgspec.msgpack.Encoder().encode
_decode_request = msgspec.msgpack.Decoder(PullRequest).decode
_decode_reply = msgspec.msgpack.Decoder(LayerHeader | PullError).decode


def gather_blocks(kv_cache: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V of these blocks, each one contiguous host tensor."""
    keys = kv_cache[0].index_select(0, index)
    values = kv_cache[1].index_select(0, index)
    if keys.device.type != "cpu":
        keys, values = keys.cpu(), values.cpu()
    return keys.contiguous(), values.contiguous()


# The transfer's streams (its gathers and scatters, and NCCL's) at high priority: while the model's
# kernels fill the GPU, a transfer's blocks go first as SMs free up instead of queueing behind a
# whole prefill's (benchmarks/pd_transfer.py measures both).
HIGH_PRIORITY = True


def transfer_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A side stream for a transfer's copies on `device` (None off CUDA)."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device, priority=-1 if HIGH_PRIORITY else 0)  # (lower is higher)


def record_compute(device: torch.device) -> torch.cuda.Event | None:
    """An event at the end of what the compute stream has enqueued so far (None off CUDA).

    A transfer's copies run on a side stream from another thread, later: ordering them after this
    event, not after the whole compute stream at that time, keeps them from waiting for the steps
    the worker enqueued since (with async scheduling there is always one)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait_for(stream: torch.cuda.Stream | None, ready: torch.cuda.Event | None) -> None:
    """Order `stream`'s next work after `ready`, or without one after all the compute stream has
    enqueued (no-op off CUDA)."""
    if stream is None:
        return
    if ready is None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    else:
        stream.wait_event(ready)


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous host tensor's memory, for a zero-copy frame (bfloat16 has no numpy type)."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


@dataclass
class HeldRequest:
    block_ids: list[int]
    deadline: float
    ready: torch.cuda.Event | None = None  # after the step that computed the blocks (record_compute)


class KVBlockServer:
    """The producer side of one worker rank: a ROUTER socket served by a daemon thread."""

    decode_request = staticmethod(_decode_request)

    def __init__(self, kv_caches: list[torch.Tensor], host: str, port: int, hold_timeout_s: float = 60.0) -> None:
        self.kv_caches = kv_caches
        self.hold_timeout_s = hold_timeout_s
        self.device = kv_caches[0].device if kv_caches else torch.device("cpu")
        # On CUDA the gathers run here, beside the model's stream, after the step that computed them.
        self.stream = transfer_stream(self.device)
        self.address = f"tcp://{host}:{port}"
        self.lock = threading.Lock()
        self.held: dict[str, HeldRequest] = {}
        self.released: set[str] = set()  # pulled or expired: their blocks may be freed
        self.send_lock = threading.Lock()  # held while reading a request's blocks
        self.hold_grace_s = 10.0
        self.gone: dict[str, None] = {}  # recently pulled / expired / dropped ids (refused at once), oldest first
        self.waiting: list[tuple[bytes, PullRequest, float]] = []  # pulls that came before their hold
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.bind(self.address)
        except zmq.ZMQError as e:
            self.socket.close()
            raise RuntimeError(f"the KV server cannot listen at {self.address}: {e} (choose another --kv-port)") from e
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, name=f"kv-server-{port}", daemon=True)
        self.thread.start()
        logger.info("KV server at %s", self.address)

    def hold(self, req_id: str, block_ids: list[int], ready: torch.cuda.Event | None = None) -> None:
        """Keep these blocks for a consumer to pull (until pulled or hold_timeout_s). On CUDA
        `ready` marks the end of the step that computes them (record_compute): a transfer waits
        for it, and for nothing enqueued after it."""
        with self.lock:
            self.held[req_id] = HeldRequest(list(block_ids), time.monotonic() + self.hold_timeout_s, ready)

    def drop(self, req_ids: list[str]) -> None:
        """Forget these holds (the scheduler freed their blocks): never read those blocks again.
        Takes the send lock, so no gather of them is in progress once this returns."""
        with self.send_lock, self.lock:
            for req_id in req_ids:
                self.held.pop(req_id, None)
                self.released.discard(req_id)
                self._forget(req_id)

    def take_released(self) -> set[str]:
        """Requests whose held blocks are done with (sent, or expired) since the last call."""
        with self.lock:
            self._expire()
            released, self.released = self.released, set()
        return released

    def _expire(self) -> None:
        now = time.monotonic()
        for req_id in [r for r, held in self.held.items() if held.deadline < now]:
            logger.warning("request %s: nobody pulled its KV within %.0f s; freeing its blocks", req_id,
                           self.hold_timeout_s)
            del self.held[req_id]
            self.released.add(req_id)
            self._forget(req_id)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self.stopped.is_set():
            self._retry_waiting()
            if not poller.poll(2 if self.waiting else 100):
                with self.lock:
                    self._expire()
                continue
            try:
                identity, payload = self.socket.recv_multipart()
                request = self.decode_request(payload)
            except (ValueError, msgspec.DecodeError) as e:  # a stray or malformed message: say so, go on
                logger.warning("KV server: bad pull request: %s", e)
                continue
            except zmq.ZMQError:
                if self.stopped.is_set():
                    return
                raise
            if not isinstance(request, PullRequest):
                try:
                    self.handle_message(identity, request)
                except Exception:  # noqa: BLE001 - one bad message must not stop the server
                    logger.exception("KV server: handling %s failed", type(request).__name__)
                continue
            try:
                with self.lock:
                    waits = request.req_id not in self.held and request.req_id not in self.gone
                if waits:
                    # The pull may overtake the hold: a worker registers it right after launching
                    # the step that completes the prompt, which nearly always precedes the answer
                    # that leads to the pull, but with tensor parallelism only rank 0's report
                    # gates that answer, and another rank may lag. Wait a little.
                    self.waiting.append((identity, request, time.monotonic() + self.hold_grace_s))
                    continue
                self._send_blocks(identity, request)
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
                logger.exception("KV server: sending %s failed", request.req_id)
                self.socket.send_multipart([identity, _encode(PullError(request.req_id, f"{type(e).__name__}: {e}"))])

    def handle_message(self, identity: bytes, message: msgspec.Struct) -> None:
        """A message other than a pull (a transport's own control message)."""
        raise ValueError(f"unexpected message {type(message).__name__}")

    def _forget(self, req_id: str) -> None:
        """Remember (a bounded number of) ids whose blocks are gone, to refuse their pulls at once."""
        self.gone[req_id] = None
        while len(self.gone) > 100_000:
            del self.gone[next(iter(self.gone))]

    def _retry_waiting(self) -> None:
        """Serve the pulls that arrived before their hold, once it is there (or refuse them once
        hold_grace_s has passed)."""
        if not self.waiting:
            return
        now = time.monotonic()
        still = []
        for identity, request, deadline in self.waiting:
            with self.lock:
                known = request.req_id in self.held
            if known or deadline < now:
                self._send_blocks(identity, request)
            else:
                still.append((identity, request, deadline))
        self.waiting = still

    def _send_blocks(self, identity: bytes, request: PullRequest) -> None:
        with self.send_lock:
            error = None
            with self.lock:
                held = self.held.get(request.req_id)
            if held is None:
                error = ("this instance holds no KV for the request (never prefilled here, already pulled, or its "
                         "hold timed out)")
            elif not set(request.block_ids) <= set(held.block_ids):
                # (A subset is fine: the consumer pulls only what its own prefix cache lacks.)
                error = f"asked for blocks {request.block_ids[:8]}..., but the request holds {held.block_ids[:8]}..."
            if error is not None:
                self.socket.send_multipart([identity, _encode(PullError(request.req_id, error))])
                return
            layers = self.read_blocks(identity, request, held.ready)
            with self.lock:
                if self.held.pop(request.req_id, None) is not None:
                    self.released.add(request.req_id)
                    self._forget(request.req_id)
        self.write_blocks(identity, request, layers)

    def read_blocks(self, identity: bytes, request: PullRequest, ready: torch.cuda.Event | None,
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Called while the lock keeps the blocks ours; once it returns they may be freed. Here:
        gathered into host copies (on CUDA one device-to-host copy per layer, on the side stream)."""
        index = torch.tensor(request.block_ids, dtype=torch.long, device=self.device)
        wait_for(self.stream, ready)
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            return [gather_blocks(kv_cache, index) for kv_cache in self.kv_caches]

    def write_blocks(self, identity: bytes, request: PullRequest, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        num_layers = len(layers)
        for layer, (keys, values) in enumerate(layers):
            header = LayerHeader(request.req_id, layer, num_layers, str(keys.dtype).removeprefix("torch."),
                                 list(keys.shape))
            # copy=False: ZMQ sends straight from the tensors' memory (they stay alive until sent).
            self.socket.send_multipart([identity, _encode(header), as_bytes(keys), as_bytes(values)], copy=False)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=2.0)
        self.socket.close(linger=0)
        self.context.term()


class _Cancelled(Exception):
    pass


@dataclass
class PullJob:
    req_id: str  # this instance's request id
    remote_req_id: str
    address: str  # tcp://host:port of the producer's rank
    remote_block_ids: list[int]
    local_block_ids: list[int]
    # On CUDA: the compute stream's work when the blocks were allocated (record_compute). Steps in
    # flight then may still touch blocks freed just before; the scatters wait for them.
    ready: torch.cuda.Event | None = None


class KVBlockPuller:
    """The consumer side of one worker rank: a daemon thread runs pull jobs one after another."""

    decode_reply = staticmethod(_decode_reply)

    def __init__(self, kv_caches: list[torch.Tensor], timeout_s: float = 30.0) -> None:
        self.kv_caches = kv_caches
        self.timeout_s = timeout_s
        self.jobs: queue.Queue[PullJob | None] = queue.Queue()
        self.lock = threading.Lock()
        self.done: set[str] = set()
        self.failed: dict[str, str] = {}
        self.cancelled: set[str] = set()
        self.scatter_lock = threading.Lock()
        self.context = zmq.Context()
        self.sockets: dict[str, zmq.Socket] = {}
        self.device = kv_caches[0].device if kv_caches else torch.device("cpu")
        # On CUDA the host-to-device copies run on their own stream, beside the model's.
        self.stream = transfer_stream(self.device)
        # (request id, bytes, seconds from pull request to the last layer in the cache) per pull.
        self.transfers: list[tuple[str, int, float]] = []
        self.thread = threading.Thread(target=self._run, name="kv-puller", daemon=True)
        self.thread.start()

    def start(self, job: PullJob) -> None:
        self.jobs.put(job)

    def cancel(self, req_ids: list[str]) -> None:
        """Stop pulling these (their blocks were freed): once this returns, nothing more of them
        is written into the cache (a layer being scattered finishes first, under the lock)."""
        with self.scatter_lock:
            self.cancelled.update(req_ids)
            if self.stream is not None:
                # Scatters already enqueued on the side stream land before the compute stream
                # reuses those blocks.
                torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def take_finished(self) -> tuple[set[str], dict[str, str]]:
        """Requests whose KV arrived, and those that failed (id -> why), since the last call."""
        with self.lock:
            done, failed = self.done, self.failed
            self.done, self.failed = set(), {}
        return done, failed

    def take_transfers(self) -> list[tuple[str, int, float]]:
        with self.lock:
            transfers, self.transfers = self.transfers, []
        return transfers

    def _socket(self, address: str) -> zmq.Socket:
        socket = self.sockets.get(address)
        if socket is None:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            self.sockets[address] = socket
        return socket

    def _drop_socket(self, address: str) -> None:
        socket = self.sockets.pop(address, None)
        if socket is not None:
            socket.close(linger=0)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            start = time.perf_counter()
            try:
                if job.req_id in self.cancelled:
                    raise _Cancelled()
                received = self._pull(job)
            except _Cancelled:
                self._drop_socket(job.address)
                with self.scatter_lock:
                    self.cancelled.discard(job.req_id)
                continue
            except Exception as e:  # noqa: BLE001 - the request fails, the thread goes on
                self._drop_socket(job.address)  # late answers of this pull must not reach the next one
                logger.warning("request %s: pulling its KV from %s failed: %s", job.req_id, job.address, e)
                with self.lock:
                    self.failed[job.req_id] = str(e)
                continue
            with self.lock:
                self.done.add(job.req_id)
                self.transfers.append((job.req_id, received, time.perf_counter() - start))

    def _pull(self, job: PullJob) -> int:
        if len(job.remote_block_ids) != len(job.local_block_ids):
            raise ValueError(f"the producer sends {len(job.remote_block_ids)} blocks, but {len(job.local_block_ids)} "
                             "were allocated here")
        socket = self._socket(job.address)
        socket.send(_encode(PullRequest(job.remote_req_id, job.remote_block_ids)))
        index = torch.tensor(job.local_block_ids, dtype=torch.long, device=self.device)
        wait_for(self.stream, job.ready)
        received = 0
        num_layers = len(self.kv_caches)
        layers_seen = 0
        while layers_seen < num_layers:
            reply, frames = self._reply(socket, job.address, lambda r: r.req_id == job.remote_req_id,
                                        f" (layer {layers_seen} of {num_layers})")
            if reply.num_layers != num_layers or reply.layer != layers_seen:
                raise RuntimeError(f"the producer sent layer {reply.layer} of {reply.num_layers}; expected layer "
                                   f"{layers_seen} of {num_layers} (is it the same model?)")
            kv_cache = self.kv_caches[reply.layer]
            expected = [len(job.local_block_ids), *kv_cache.shape[2:]]
            if reply.shape != expected or reply.dtype not in _DTYPES:
                raise RuntimeError(f"the producer's KV blocks are {reply.dtype} {reply.shape}; this instance's are "
                                   f"{kv_cache.dtype} {expected} (is it the same model and block size?)")
            dtype = _DTYPES[reply.dtype]
            keys = torch.frombuffer(frames[1].buffer, dtype=dtype).view(reply.shape)
            values = torch.frombuffer(frames[2].buffer, dtype=dtype).view(reply.shape)
            with self.scatter_lock:
                if job.req_id in self.cancelled:
                    raise _Cancelled()
                self._scatter(kv_cache, index, keys, values)
            received += frames[1].buffer.nbytes + frames[2].buffer.nbytes
            layers_seen += 1
        if self.stream is not None:
            self.stream.synchronize()  # in the cache before the request may run
        return received

    def _reply(self, socket: zmq.Socket, address: str, wanted: Callable[[Any], bool], waiting_for: str = "") -> tuple:
        """The producer's next answer that `wanted` accepts, and its frames (answers it does not:
        late ones to an earlier pull that gave up, are skipped); a refusal raises."""
        while True:
            if not socket.poll(int(self.timeout_s * 1000)):
                raise TimeoutError(f"the producer at {address} sent nothing for {self.timeout_s:g} s{waiting_for}; "
                                   "it may have died")
            frames = socket.recv_multipart(copy=False)
            reply = self.decode_reply(frames[0].buffer)
            if not wanted(reply):
                continue
            if isinstance(reply, PullError):
                raise RuntimeError(f"the producer at {address} refused: {reply.error}")
            return reply, frames

    def _scatter(self, kv_cache: torch.Tensor, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.stream is None:
            kv_cache[0].index_copy_(0, index, keys.to(kv_cache.dtype))
            kv_cache[1].index_copy_(0, index, values.to(kv_cache.dtype))
            return
        with torch.cuda.stream(self.stream):
            # The frames' memory is pageable: a synchronous copy, then the scatter on the side stream.
            kv_cache[0].index_copy_(0, index, keys.to(self.device))
            kv_cache[1].index_copy_(0, index, values.to(self.device))

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=2.0)
        for address in list(self.sockets):
            self._drop_socket(address)
        self.context.term()
