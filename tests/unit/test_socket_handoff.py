"""The EngineCore's busy loop lets the socket thread send a step's outputs before a large block
update (EngineCoreProc._let_socket_thread_send): it returns once everything it emitted was
forwarded, and at its deadline if the socket thread never gets to it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from minivllm.core import engine_core
from minivllm.core.engine_core import EngineCoreProc


def test_the_busy_loop_waits_until_the_socket_thread_forwarded(monkeypatch) -> None:
    monkeypatch.setattr(engine_core, "_HANDOFF_WAIT_S", 30.0)  # only the forward can end the wait
    proc = SimpleNamespace(num_emitted=3, num_forwarded=1, forwarded=threading.Event())

    def socket_thread() -> None:
        time.sleep(0.05)  # (busy elsewhere first)
        for _ in range(2):
            proc.num_forwarded += 1
            proc.forwarded.set()  # (a batch at a time: the first set comes before all are out)

    forwarder = threading.Thread(target=socket_thread)
    forwarder.start()
    EngineCoreProc._let_socket_thread_send(proc)
    assert proc.num_forwarded == 3
    forwarder.join()
    EngineCoreProc._let_socket_thread_send(proc)  # all forwarded: nothing to wait for


def test_the_busy_loop_gives_up_at_the_deadline(monkeypatch) -> None:
    monkeypatch.setattr(engine_core, "_HANDOFF_WAIT_S", 0.01)
    proc = SimpleNamespace(num_emitted=2, num_forwarded=1, forwarded=threading.Event())
    proc.forwarded.set()  # a stale signal from an earlier batch
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (EngineCoreProc._let_socket_thread_send(proc), done.set()), daemon=True)
    waiter.start()
    assert done.wait(30), "the busy loop waited past its deadline"
    assert proc.num_forwarded == 1
