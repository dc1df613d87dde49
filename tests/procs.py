"""Process helpers for tests: is a pid alive (zombies count as gone), wait for it to go, a
process's children, kill one in the middle of a long generate."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Wait until none of `pids` is alive; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def child_processes(pid: int) -> dict[int, str]:
    """pid's child processes: {pid: command line, arguments joined by spaces}."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if ppid == pid:
            found[int(entry)] = cmdline
    return found


def kill_during_generate(llm, victim: int | Callable[[], object], match: str, *, num_requests: int = 32,
                         max_tokens: int = 400, delay: float = 0.25, within: float = 15.0) -> None:
    """SIGKILL the process `victim` (or call `victim`: e.g. take a node down) `delay` seconds after a
    generate of many long requests has them in the engine: the generate must raise EngineDeadError
    matching `match` within `within` s. (Timed from the requests' arrival, not from the call, so
    that a fast machine cannot finish the job before the kill.)"""
    import pytest

    from minivllm import SamplingParams
    from minivllm.frontend.core_client import EngineDeadError

    long_job = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    kill = victim if callable(victim) else lambda: os.kill(victim, signal.SIGKILL)
    killed_mid_job: list[bool] = []

    def kill_once_running() -> None:
        deadline = time.monotonic() + within
        while not llm.get_unfinished_request_ids() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(delay)
        killed_mid_job.append(bool(llm.get_unfinished_request_ids()))
        kill()

    killer = threading.Thread(target=kill_once_running, daemon=True)
    start = time.monotonic()
    killer.start()
    with pytest.raises(EngineDeadError, match=match):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * num_requests, long_job, use_tqdm=False)
    assert time.monotonic() - start < within
    killer.join(timeout=within)
    assert killed_mid_job == [True], "the job finished before the kill: make it longer"


class StartedEngines:
    """engines(*args, **settings) -> the LLM `start(*args, **settings)` made, started once per
    distinct settings (for module-scoped fixtures: each engine costs seconds to start)."""

    def __init__(self, start) -> None:
        self.start = start
        self.started: dict[tuple, object] = {}

    def __call__(self, *args, **settings):
        key = (args, repr(sorted(settings.items())))
        if key not in self.started:
            self.started[key] = self.start(*args, **settings)
        return self.started[key]

    def shutdown(self) -> None:
        for llm in self.started.values():
            llm.shutdown()
