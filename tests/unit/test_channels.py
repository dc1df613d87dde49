"""The EngineCore <-> worker channels (protocol/channels.py) and the executor's use of socket pairs:
messages arrive whole and in order whatever their size, a sender's loop never blocks on a full
socket, and a worker whose end closes becomes a WorkerDiedError naming it."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import zmq

from minivllm.core.executor import ChannelExecutor, WorkerDiedError
from minivllm.protocol.channels import ChannelClosed, StreamChannel, fd_address, open_worker_channels
from minivllm.protocol.messages import Shutdown, WorkerCall, WorkerReply
from minivllm.protocol.serial import encode, worker_input_decoder

SIZES = [0, 1, 7, 65_535, 65_536, 300_000, 5_000_000]  # around the one-write limit, past a socket's buffer


def _message(i: int, size: int) -> bytes:
    return bytes([i % 251]) * size


def test_messages_arrive_whole_and_in_order_and_the_sender_never_blocks() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender, receiver = StreamChannel(ours), StreamChannel(theirs)
    try:
        start = time.monotonic()
        for i, size in enumerate(SIZES):  # nobody reads yet: what does not fit waits in the outbox
            sender.send(_message(i, size))
        assert time.monotonic() - start < 1.0
        assert sender.has_unsent  # 5 MB never fit a Unix socket's buffer
        received: list[bytes] = []
        reader = threading.Thread(target=lambda: received.extend(bytes(receiver.recv()) for _ in SIZES))
        reader.start()
        while not sender.flush():  # what the executor does while it waits for answers
            time.sleep(0.001)
        reader.join(timeout=10)
        assert received == [_message(i, size) for i, size in enumerate(SIZES)]
        assert not sender.has_unsent and not receiver.poll(0)
    finally:
        sender.close()
        receiver.close()


def test_send_with_wait_returns_once_written() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender, receiver = StreamChannel(ours), StreamChannel(theirs)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(bytes(receiver.recv())))
    reader.start()
    sender.send(_message(3, 2_000_000), wait=True)
    assert not sender.has_unsent
    reader.join(timeout=10)
    assert received == [_message(3, 2_000_000)]
    sender.close()
    receiver.close()


def test_a_closed_end_is_channel_closed_both_ways() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = StreamChannel(ours)
    theirs.close()
    assert channel.poll(1000)  # the end of the stream is readable at once
    with pytest.raises(ChannelClosed):
        channel.recv()
    with pytest.raises(ChannelClosed):
        channel.send(b"x" * 1000)
    channel.close()


def test_a_message_cut_short_is_channel_closed() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = StreamChannel(ours)
    theirs.sendall((1000).to_bytes(8, "little") + b"only part")
    theirs.close()
    with pytest.raises(ChannelClosed):
        channel.recv()
    channel.close()


def test_an_inherited_address_is_one_channel_both_ways() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="both ways"):
            open_worker_channels(ctx, fd_address(theirs.fileno()), fd_address(ours.fileno()))
        address = fd_address(theirs.detach())
        work, results = open_worker_channels(ctx, address, address)
        assert work is results and isinstance(work, StreamChannel)
        engine = StreamChannel(ours)
        engine.send(b"step")
        assert work.recv() == b"step"
        results.send(b"tokens", wait=True)
        assert engine.recv() == b"tokens"
        work.close()
        engine.close()
    finally:
        ctx.destroy()


class _ThreadWorkers(ChannelExecutor):
    """Workers as threads of this process on the executor's socket pairs, answering each WorkerCall
    with the length of its first argument; at a call to "exit" rank 0 closes its end instead (the
    others answer it)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.closed: set[int] = set()
        self.ctx_workers = zmq.Context()
        self.threads = []
        for rank, end in enumerate(self.open_socket_pairs()):
            address = fd_address(end.detach())
            thread = threading.Thread(target=self._serve, args=(rank, address), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _serve(self, rank: int, address: str) -> None:
        work, results = open_worker_channels(self.ctx_workers, address, address)
        assert work is results
        while True:
            message = worker_input_decoder.decode(work.recv())
            if isinstance(message, Shutdown):
                break
            assert isinstance(message, WorkerCall)
            if message.method == "exit" and rank == 0:
                self.closed.add(rank)
                break
            results.send(encode(WorkerReply(rank, message.method, len(message.args[0]))), wait=True)
        work.close()

    def dead_worker(self, rank: int) -> str | None:
        return f"worker {rank} (a thread) exited" if rank in self.closed else None

    def describe_workers(self) -> str:
        return "thread workers"

    def stop_workers(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout)


def _config(tiny_llama):
    from minivllm.protocol.config import EngineConfig

    return EngineConfig.create(tiny_llama, device="cpu", tensor_parallel_size=2)


def test_executor_sends_calls_past_a_full_socket_while_it_waits(tiny_llama) -> None:
    executor = _ThreadWorkers(_config(tiny_llama))
    try:
        assert executor.result_channels == executor.work_channels and len(executor.work_channels) == 2
        assert executor.collective_rpc("size", "a" * 5_000_000) == [5_000_000, 5_000_000]
        assert executor.collective_rpc("size", "b") == [1, 1]
    finally:
        executor.shutdown()


def test_executor_names_a_worker_whose_channel_closed(tiny_llama) -> None:
    executor = _ThreadWorkers(_config(tiny_llama))
    try:
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker 0 \\(a thread\\) exited"):
            executor.collective_rpc("exit", "")
        assert time.monotonic() - start < 1.0  # the closed socket tells at once: no 1 s liveness poll
    finally:
        executor.shutdown()


def test_local_workers_get_no_socket_address(tiny_llama) -> None:
    """A local worker's channel is a socket pair it inherits: no ipc:// file exists for another
    process to connect to."""
    from minivllm.core.executor import MpExecutor
    from minivllm.protocol.config import EngineConfig
    from minivllm.protocol.ipc import private_socket_dir

    before = set(os.listdir(private_socket_dir()))
    executor = MpExecutor(EngineConfig.create(tiny_llama, device="cpu", max_model_len=128))
    try:
        assert all(isinstance(channel, StreamChannel) for channel in executor.work_channels)
        assert not any(name.startswith("worker") for name in set(os.listdir(private_socket_dir())) - before)
        num_blocks = executor.collective_rpc("determine_num_blocks")  # a call there and back
        assert len(num_blocks) == 1 and num_blocks[0] > 0
    finally:
        executor.shutdown()
