"""Process helpers for tests: is a pid alive (zombies count as gone), wait for it to go."""

from __future__ import annotations

import time


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
