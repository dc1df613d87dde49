"""The executor's sockets when workers are on other nodes: TCP, and only a peer holding this
executor's CURVE key gets through (a worker without it sends nothing the executor reads)."""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from minivllm.core.executor import ChannelExecutor
from minivllm.protocol.auth import HANDSHAKE_FAILED_EVENTS, HANDSHAKE_FAILURES, CurveKeys
from minivllm.protocol.messages import WorkerReply
from minivllm.protocol.serial import encode, worker_output_decoder


class _NoWorkers(ChannelExecutor):
    def dead_worker(self, rank: int) -> None:
        return None

    def stop_workers(self, timeout: float) -> None:
        pass


def _config(tiny_llama):
    from minivllm.protocol.config import EngineConfig

    return EngineConfig.create(tiny_llama, device="cpu", tensor_parallel_size=2)


def test_tcp_sockets_admit_only_the_executors_key(tiny_llama) -> None:
    executor = _NoWorkers(_config(tiny_llama))
    executor.bind_sockets("127.0.0.1")
    ctx = zmq.Context()
    try:
        assert executor.curve_secret is not None
        assert executor.result_address.startswith("tcp://127.0.0.1:")
        assert len(executor.work_addresses) == 2 and all(a.startswith("tcp://") for a in executor.work_addresses)

        stranger = ctx.socket(zmq.PUSH)  # no key at all
        impostor = ctx.socket(zmq.PUSH)  # a key of its own
        CurveKeys("an-engine-key-of-somebody-else").make_client(impostor)
        for sock in (stranger, impostor):
            monitor = sock.get_monitor_socket(HANDSHAKE_FAILED_EVENTS)
            sock.connect(executor.result_address)
            assert monitor.poll(5000), "the handshake should fail"
            assert recv_monitor_message(monitor)["event"] in HANDSHAKE_FAILURES
            try:  # whatever it manages to queue never reaches the executor
                sock.send(encode(WorkerReply(0, "ready", 1)), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
        results = executor.result_channels[0]
        assert not results.poll(1000)

        worker = ctx.socket(zmq.PUSH)
        CurveKeys(executor.curve_secret).make_client(worker)
        worker.connect(executor.result_address)
        worker.send(encode(WorkerReply(1, "ready", 42)))
        assert results.poll(5000)
        assert worker_output_decoder.decode(results.recv()) == WorkerReply(1, "ready", 42)

        inbox = ctx.socket(zmq.PULL)  # and the work sockets: a keyed worker receives its steps
        CurveKeys(executor.curve_secret).make_client(inbox)
        inbox.connect(executor.work_addresses[1])
        executor.work_channels[1].send(b"step")
        assert inbox.poll(5000) and inbox.recv() == b"step"
    finally:
        ctx.destroy(linger=0)
        executor.shutdown()


def test_shutdown_returns_when_the_context_never_terminates(tiny_llama, monkeypatch, caplog) -> None:
    """A socket the executor does not know of (opened through another handle on its ZMQ context)
    keeps the context from terminating: shutdown still returns, after CONTEXT_TERM_TIMEOUT_S, and
    says so, instead of hanging (as one CPU suite run once did in the test above)."""
    import logging
    import time

    from minivllm.core import executor as executor_module

    monkeypatch.setattr(executor_module, "CONTEXT_TERM_TIMEOUT_S", 0.5)
    executor = _NoWorkers(_config(tiny_llama))
    executor.bind_sockets("127.0.0.1")
    foreign = zmq.Context.shadow(executor.ctx.underlying).socket(zmq.PUSH)  # not in executor.ctx's own list
    try:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger=executor_module.__name__):
            executor.shutdown()
        assert time.monotonic() - started < 5.0
        assert "did not terminate" in caplog.text
    finally:
        foreign.close(linger=0)  # (the context's termination, waiting in its thread, then completes)
