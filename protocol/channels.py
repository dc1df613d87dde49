"""The channels between the EngineCore and its workers: ordered messages of msgspec bytes, each
way. Nothing here decodes or pickles; a channel only moves bytes.

Two kinds, one interface (send, send_nowait, poll, recv, close, and `pollable` for a zmq.Poller):
  StreamChannel  one end of a Unix socket pair, each message framed by its length. Local workers
                 (MpExecutor): the EngineCore makes one pair per worker and the worker inherits
                 its end, so no address exists that anything else could connect to.
  ZmqChannel     a ZMQ socket: workers that may be on other nodes (Ray), over CURVE TCP there.
Why two: ZMQ moves each message through its I/O threads, so a hop costs thread wake-ups on both
sides. On an H100 host a 300-byte round trip between two processes took 115 us over ipc:// ZMQ
against 35 us over a socket pair (140 / 40 on an H200 host; benchmarks/results/2026-11-26-channels/),
and a batch-1 first token crosses that hop twice.

A worker names its channel by address (`open_worker_channels`): "fd:N" is an inherited socket,
anything else a ZMQ endpoint.
"""

from __future__ import annotations

import select
import socket
from collections import deque

import zmq

_HEADER_BYTES = 8  # a message's length, little-endian
_SMALL_MESSAGE = 1 << 16  # smaller messages go out as one write with their header (one copy)


class ChannelClosed(ConnectionError):
    """The other end is gone (its process exited or closed the channel)."""


class StreamChannel:
    """Length-framed messages over a connected stream socket, both ways.

    Sending never blocks the sender's loop: what the socket does not take at once waits in an
    outbox that `flush` writes later (the executor flushes while it waits for results). With
    wait=True, send returns once the whole message is written (a worker's answers)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self.pollable = sock.fileno()
        self._outbox: deque[memoryview] = deque()
        # (poll, not select: select fails on descriptors past 1023, which a busy process may reach)
        self._readable, self._writable = select.poll(), select.poll()
        self._readable.register(self.pollable, select.POLLIN)
        self._writable.register(self.pollable, select.POLLOUT)

    def send(self, payload: bytes, wait: bool = False) -> None:
        header = len(payload).to_bytes(_HEADER_BYTES, "little")
        if len(payload) < _SMALL_MESSAGE:
            self._outbox.append(memoryview(header + payload))
        else:
            self._outbox.extend((memoryview(header), memoryview(payload)))
        while not self.flush() and wait:
            self._writable.poll()

    def send_nowait(self, payload: bytes) -> None:
        """send: it never waits (what the socket does not take stays in the outbox)."""
        self.send(payload)

    def flush(self) -> bool:
        """Write what waits in the outbox as far as the socket takes it now; True once all is out."""
        outbox = self._outbox
        while outbox:
            try:
                sent = self.sock.send(outbox[0], socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError as e:  # EPIPE, ECONNRESET: the reader is gone
                raise ChannelClosed(f"the other end of the channel is gone ({e})") from e
            if sent == len(outbox[0]):
                outbox.popleft()
            else:
                outbox[0] = outbox[0][sent:]
        return True

    @property
    def has_unsent(self) -> bool:
        return bool(self._outbox)

    def poll(self, timeout_ms: int) -> bool:
        """Whether a message (at least its first bytes) can be read, waiting up to timeout_ms."""
        return bool(self._readable.poll(timeout_ms))

    def recv(self) -> bytearray:
        """The next message, waiting for it. Raises ChannelClosed at the end of the stream."""
        size = int.from_bytes(self._read_exactly(_HEADER_BYTES), "little")
        return self._read_exactly(size)

    def _read_exactly(self, size: int) -> bytearray:
        data = bytearray(size)
        view = memoryview(data)
        received = 0
        while received < size:
            try:
                count = self.sock.recv_into(view[received:])
            except OSError as e:  # ECONNRESET
                raise ChannelClosed(f"the other end of the channel is gone ({e})") from e
            if count == 0:
                raise ChannelClosed("the other end of the channel closed it")
            received += count
        return data

    def close(self) -> None:
        self.sock.close()


class ZmqChannel:
    """A ZMQ socket behind the channel interface (PUSH to send, PULL to receive). ZMQ queues what
    it sends, so nothing is ever left unsent here."""

    has_unsent = False

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.pollable = sock

    def send(self, payload: bytes, wait: bool = False) -> None:
        self.sock.send(payload)

    def send_nowait(self, payload: bytes) -> None:
        """send, unless ZMQ would have to wait (no peer connected, its queue full): then nothing."""
        try:
            self.sock.send(payload, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def flush(self) -> bool:
        return True

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def recv(self) -> bytes:
        return self.sock.recv()

    def close(self) -> None:
        self.sock.close(linger=0)


Channel = StreamChannel | ZmqChannel


def fd_address(fd: int) -> str:
    """The address under which a worker finds the socket it inherited as file descriptor `fd`."""
    return f"fd:{fd}"


def open_worker_channels(ctx: zmq.Context, work_address: str, result_address: str,
                         curve_secret: str | None = None) -> tuple[Channel, Channel]:
    """A worker's (work, results) channels: one socket pair end for both when the address is
    "fd:N", else a ZMQ PULL and PUSH connected to the executor's endpoints (with the executor's
    CURVE key when it set one)."""
    if work_address.startswith("fd:"):
        if result_address != work_address:
            raise ValueError(f"an inherited socket carries both ways: got {work_address} and {result_address}")
        channel = StreamChannel(socket.socket(fileno=int(work_address[len("fd:"):])))
        return channel, channel
    work_socket, result_socket = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    if curve_secret is not None:
        from minivllm.protocol.auth import CurveKeys

        keys = CurveKeys(curve_secret)
        keys.make_client(work_socket)
        keys.make_client(result_socket)
    work_socket.connect(work_address)
    result_socket.connect(result_address)
    return ZmqChannel(work_socket), ZmqChannel(result_socket)
