"""Moving one request's KV blocks between two instances GPU to GPU (the P2pNcclConnector's transport).

The control plane is pd_zmq_transport's (a consumer rank's DEALER asks the producer rank's ROUTER
for a request's blocks; holds, timeouts and refusals work the same); only the bytes travel
differently: device to device through torch.distributed point-to-point send/recv, NCCL when the
caches are on CUDA (NVLink or PCIe on one host, the network across hosts) and gloo on CPU, so the
same code runs in CI.

Each (producer rank, consumer rank) pair has a two-member process group of its own, made when the
consumer first pulls from that producer: the producer runs a TCPStore at kv_ip (port chosen by the
OS), tells the consumer its port, and both build the group on it (producer member 0). It does not
touch the default process group the tensor-parallel ranks use.

A transfer is a TransferHeader over ZMQ, then the blocks in chunks of whole layers (at most
CHUNK_BYTES each, [layers, 2, blocks, ...]), sent from and received into two staging buffers in
turn: the producer gathers chunk c+1 while chunk c is on the wire, and the consumer scatters chunk
c into its paged cache while c+1 arrives, on a side stream beside the model's. The consumer
scatters a chunk only once it has fully arrived, so a cancelled or failed pull never leaves a
half-written block behind a stream that waits on the network.

A peer that dies mid-transfer: the survivor's wait times out (timeout_s), it aborts that pair's
group (NCCL kernels waiting on the dead peer are cancelled; gloo fails at once on the closed
connection) and drops it; the request fails with a clear error (consumer) or its blocks are freed
(producer); the next pull between the two builds a new group.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
import uuid

import msgspec
import torch
import torch.distributed as dist
import zmq

from minivllm.worker.attention.kv_cache import stacked_layers
from minivllm.worker.kv_connector import pd_zmq_transport
from minivllm.worker.kv_connector.pd_zmq_transport import (
    _DTYPES,
    KVBlockPuller,
    KVBlockServer,
    PullError,
    PullJob,
    PullRequest,
    _Cancelled,
    _encode,
    wait_for,
)

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # one staging buffer (two per transfer at each end)


class GroupRequest(msgspec.Struct, tag="group"):
    pair_id: str  # the consumer rank's name for this pair (the group's store prefix)


class GroupReply(msgspec.Struct, tag="group_ok"):
    pair_id: str
    store_port: int  # the producer's TCPStore, at the address the consumer pulls from
    backend: str  # "nccl" or "gloo": both members must use the producer's


class TransferHeader(msgspec.Struct, tag="transfer"):
    req_id: str
    num_layers: int
    layers_per_chunk: int
    dtype: str
    shape: list[int]  # of one layer's blocks: [2, num_blocks, *block_shape]


_decode_request = msgspec.msgpack.Decoder(PullRequest | GroupRequest).decode
_decode_reply = msgspec.msgpack.Decoder(TransferHeader | PullError | GroupReply).decode


def make_pair_group(store: dist.Store, pair_id: str, member: int, backend: str, timeout_s: float) -> dist.ProcessGroup:
    """A two-member process group on `store`, apart from the default group (tensor parallelism's)."""
    prefixed = dist.PrefixStore(f"kv-pair/{pair_id}/", store)
    # Beyond our own deadline (timeout_s), so our abort comes first, not NCCL's watchdog.
    timeout = datetime.timedelta(seconds=timeout_s + 60)
    if backend == "nccl":
        # NCCL's own stream as the transport's (see pd_zmq_transport.transfer_stream).
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=pd_zmq_transport.HIGH_PRIORITY)
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, member, 2, options)
    return dist.ProcessGroupGloo(prefixed, member, 2, timeout)


def abort_group(group: dist.ProcessGroup) -> None:
    """Cancel a pair group's pending operations (a peer died); the group is not used again."""
    for name in ("abort", "_abort", "shutdown"):
        method = getattr(group, name, None)
        if method is not None:
            try:
                method()
            except Exception as e:  # noqa: BLE001 - best effort: the group is dropped anyway
                logger.debug("aborting a KV pair group with %s() failed: %s", name, e)
            return


def layers_per_chunk(layer_bytes: int) -> int:
    return max(1, CHUNK_BYTES // max(1, layer_bytes))


class _Completion:
    """Waiting for a chunk's point-to-point operation without blocking forever on a dead peer."""

    def __init__(self, cuda: bool, timeout_s: float) -> None:
        self.cuda = cuda
        self.timeout_s = timeout_s

    def wait(self, work: dist.Work, what: str, abandon=lambda: False) -> None:
        if not self.cuda:
            # gloo: wait() itself fails when the peer's connection closes, or after the timeout.
            work.wait(datetime.timedelta(seconds=self.timeout_s))
            return
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if abandon():
                raise _Cancelled()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not complete in {self.timeout_s:g} s; the peer may have died")
            time.sleep(0.0002)


class NcclBlockServer(KVBlockServer):
    """The producer side of one worker rank: ZMQ for control, a pair group per consumer for bytes."""

    decode_request = staticmethod(_decode_request)

    def __init__(self, kv_caches: list[torch.Tensor], host: str, port: int, hold_timeout_s: float = 60.0,
                 transfer_timeout_s: float = 30.0) -> None:
        self.cuda = bool(kv_caches) and kv_caches[0].device.type == "cuda"
        self.backend = "nccl" if self.cuda else "gloo"
        self.host = host
        self.transfer_timeout_s = transfer_timeout_s
        self.store: dist.TCPStore | None = None
        self.groups: dict[bytes, dist.ProcessGroup] = {}  # consumer identity -> its pair group
        self.completion = _Completion(self.cuda, transfer_timeout_s)
        self.stacked = stacked_layers(kv_caches, "the NCCL KV transport")  # [layers, 2, blocks, ...]
        super().__init__(kv_caches, host, port, hold_timeout_s)

    def handle_message(self, identity: bytes, message: msgspec.Struct) -> None:
        if not isinstance(message, GroupRequest):
            raise ValueError(f"unexpected message {type(message).__name__}")
        if self.cuda:
            torch.cuda.set_device(self.device)
        if self.store is None:
            # The OS picks the port; consumers learn it from the reply.
            self.store = dist.TCPStore(self.host, 0, None, True, timeout=datetime.timedelta(seconds=30),
                                       wait_for_workers=False)
        old = self.groups.pop(identity, None)
        if old is not None:  # the consumer rebuilt its side (after a failure): so do we
            abort_group(old)
        self.socket.send_multipart([identity, _encode(GroupReply(message.pair_id, self.store.port, self.backend))])
        # gloo's constructor waits for the consumer to join (it does so on this reply); NCCL's
        # connects lazily, on the first transfer.
        self.groups[identity] = make_pair_group(self.store, message.pair_id, 0, self.backend, self.transfer_timeout_s)
        logger.info("KV pair group (%s) with a consumer made", self.backend)

    def read_blocks(self, identity: bytes, request: PullRequest, ready: torch.cuda.Event | None) -> list:
        """The whole transfer, while the lock keeps the blocks ours."""
        group = self.groups.get(identity)
        if group is None:
            self.socket.send_multipart([identity, _encode(PullError(
                request.req_id, "no KV pair group with this consumer (it must send a GroupRequest first)"))])
            return []
        first = self.kv_caches[0]
        shape = [2, len(request.block_ids), *first.shape[2:]]
        per_chunk = layers_per_chunk(first[:, :1].numel() * first.element_size() * len(request.block_ids))
        header = TransferHeader(request.req_id, len(self.kv_caches), per_chunk,
                                str(first.dtype).removeprefix("torch."), shape)
        self.socket.send_multipart([identity, _encode(header)])
        try:
            self._send_chunks(group, request.block_ids, shape, per_chunk, ready)
        except Exception as e:  # noqa: BLE001 - the consumer's pull fails; the blocks are released
            logger.warning("request %s: sending its KV failed (%s); dropping the pair group", request.req_id, e)
            abort_group(self.groups.pop(identity))
        return []

    def _send_chunks(self, group: dist.ProcessGroup, block_ids: list[int], shape: list[int], per_chunk: int,
                     ready: torch.cuda.Event | None) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        num_layers = len(self.kv_caches)
        first = self.kv_caches[0]
        buffers = [torch.empty([min(per_chunk, num_layers), *shape], dtype=first.dtype, device=self.device)
                   for _ in range(2 if num_layers > per_chunk else 1)]
        wait_for(self.stream, ready)  # (the step that computed the blocks)
        works: list[dist.Work] = []
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            for chunk, start in enumerate(range(0, num_layers, per_chunk)):
                layers = self.kv_caches[start:start + per_chunk]
                buffer = buffers[chunk % len(buffers)][:len(layers)]
                if chunk >= len(buffers):
                    # The buffer's previous send must be done before it is refilled.
                    if self.cuda:
                        works[chunk - len(buffers)].wait()  # the side stream waits, not the CPU
                    else:
                        self.completion.wait(works[chunk - len(buffers)], "a KV send")
                # One kernel gathers the chunk's layers: while the model's kernels fill the GPU a
                # transfer runs ~10x slower (benchmarks/pd_transfer.py), each of its kernels
                # presumably waiting for SMs to free up, so it should have few.
                torch.index_select(self.stacked[start:start + per_chunk], 2, index, out=buffer)
                works.append(group.send([buffer], 1, chunk))
            # (gloo: a send already waited for is not waited for again.)
            for work in works if self.cuda else works[-len(buffers):]:
                self.completion.wait(work, "a KV send")

    def close(self) -> None:
        super().close()
        for group in self.groups.values():
            abort_group(group)
        self.groups.clear()


class NcclBlockPuller(KVBlockPuller):
    """The consumer side of one worker rank: pulls through pair groups, one per producer rank."""

    decode_reply = staticmethod(_decode_reply)

    def __init__(self, kv_caches: list[torch.Tensor], timeout_s: float = 30.0) -> None:
        # (Set before the base class starts the puller thread.)
        self.cuda = bool(kv_caches) and kv_caches[0].device.type == "cuda"
        self.groups: dict[str, dist.ProcessGroup] = {}  # producer address -> pair group
        self.stores: dict[str, dist.TCPStore] = {}
        self.completion = _Completion(self.cuda, timeout_s)
        self.stacked = stacked_layers(kv_caches, "the NCCL KV transport")
        super().__init__(kv_caches, timeout_s)

    def _group(self, address: str, socket: zmq.Socket) -> dist.ProcessGroup:
        group = self.groups.get(address)
        if group is not None:
            return group
        if self.cuda:
            torch.cuda.set_device(self.device)
        pair_id = uuid.uuid4().hex
        socket.send(_encode(GroupRequest(pair_id)))
        reply = self._reply(socket, address, lambda r: isinstance(r, GroupReply) and r.pair_id == pair_id)[0]
        host = address.removeprefix("tcp://").rsplit(":", 1)[0]
        store = dist.TCPStore(host, reply.store_port, None, False, timeout=datetime.timedelta(seconds=self.timeout_s))
        group = make_pair_group(store, pair_id, 1, reply.backend, self.timeout_s)
        self.stores[address], self.groups[address] = store, group
        return group

    def _drop_socket(self, address: str) -> None:
        super()._drop_socket(address)
        group = self.groups.pop(address, None)
        if group is not None:  # a failed or abandoned transfer: the pair starts over next time
            abort_group(group)
        self.stores.pop(address, None)

    def _pull(self, job: PullJob) -> int:
        if len(job.remote_block_ids) != len(job.local_block_ids):
            raise ValueError(f"the producer sends {len(job.remote_block_ids)} blocks, but {len(job.local_block_ids)} "
                             "were allocated here")
        socket = self._socket(job.address)
        group = self._group(job.address, socket)
        socket.send(_encode(PullRequest(job.remote_req_id, job.remote_block_ids)))
        header = self._reply(socket, job.address, lambda r: getattr(r, "req_id", None) == job.remote_req_id)[0]
        num_layers = len(self.kv_caches)
        first = self.kv_caches[0]
        expected = [2, len(job.local_block_ids), *first.shape[2:]]
        if header.num_layers != num_layers or header.shape != expected or header.dtype not in _DTYPES \
                or _DTYPES[header.dtype] != first.dtype:
            raise RuntimeError(f"the producer's KV is {header.num_layers} layers of {header.dtype} {header.shape}; "
                               f"this instance's is {num_layers} of {first.dtype} {expected} (is it the same model, "
                               "block size and kv_cache_dtype?)")
        index = torch.tensor(job.local_block_ids, dtype=torch.long, device=self.device)
        per_chunk = header.layers_per_chunk
        starts = list(range(0, num_layers, per_chunk))
        buffers = [torch.empty([min(per_chunk, num_layers), *expected], dtype=first.dtype, device=self.device)
                   for _ in range(min(2, len(starts)))]
        abandoned = lambda: job.req_id in self.cancelled  # noqa: E731
        received = 0
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            works = {}
            for chunk in range(min(2, len(starts))):
                works[chunk] = self._recv(group, buffers, chunk, starts, num_layers)
            wait_for(self.stream, job.ready)  # before the scatters (the receives into staging need not wait)
            for chunk, start in enumerate(starts):
                self.completion.wait(works.pop(chunk), f"layer {start} of {num_layers} from {job.address}", abandoned)
                buffer = buffers[chunk % len(buffers)]
                layers = self.kv_caches[start:start + per_chunk]
                with self.scatter_lock:
                    if job.req_id in self.cancelled:
                        raise _Cancelled()
                    self.stacked[start:start + per_chunk].index_copy_(2, index, buffer[:len(layers)])  # (one kernel)
                received += buffer[:len(layers)].numel() * first.element_size()
                if chunk + 2 < len(starts):
                    # Issued after the scatter on this stream: the receive waits for it to read the buffer.
                    works[chunk + 2] = self._recv(group, buffers, chunk + 2, starts, num_layers)
        if self.cuda:
            self.stream.synchronize()  # in the cache before the request may run
        return received

    @staticmethod
    def _recv(group: dist.ProcessGroup, buffers: list[torch.Tensor], chunk: int, starts: list[int],
              num_layers: int) -> dist.Work:
        end = starts[chunk + 1] if chunk + 1 < len(starts) else num_layers
        return group.recv([buffers[chunk % len(buffers)][:end - starts[chunk]]], 0, chunk)

    def _run(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        super()._run()

    def close(self) -> None:
        super().close()
        for group in self.groups.values():
            abort_group(group)
        self.groups.clear()
