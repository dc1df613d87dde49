"""protocol/gc_heap.py: what is alive at the freeze leaves the collector's passes, what comes after is
collected as usual, and $MINIVLLM_GC_FREEZE=0 leaves the collector alone. Each case runs in a
process of its own: a freeze would stay in this one for the rest of the session."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# A cycle made before the freeze and one made after, both dropped; a full pass then frees only the later
# one (a frozen object is never examined). Garbage that exists at the freeze is collected by it first.
SCRIPT = textwrap.dedent("""
    import gc, weakref
    from minivllm.protocol.gc_heap import freeze_gc_heap

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a

    garbage_before = weakref.ref(cycle())  # unreachable already: the freeze's own pass frees it
    alive = cycle()
    frozen = freeze_gc_heap("test")
    print("frozen", frozen, gc.get_freeze_count())
    print("garbage before the freeze freed", garbage_before() is None)
    before = weakref.ref(alive)
    del alive
    after = weakref.ref(cycle())
    gc.collect()
    print("cycle dropped after the freeze freed", after() is None)
    print("frozen cycle dropped later freed", before() is None)
""")


def _run(env_value: str | None) -> list[str]:
    env = dict(os.environ)
    env.pop("MINIVLLM_GC_FREEZE", None)
    if env_value is not None:
        env["MINIVLLM_GC_FREEZE"] = env_value
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_heap_alive_at_the_freeze_leaves_the_collectors_passes() -> None:
    lines = _run(None)
    _, frozen, count = lines[0].split()
    assert int(frozen) == int(count) > 1000  # the interpreter's own objects and the imports, at least
    assert lines[1:] == ["garbage before the freeze freed True", "cycle dropped after the freeze freed True",
                         "frozen cycle dropped later freed False"]


def test_gc_freeze_0_leaves_the_collector_alone() -> None:
    lines = _run("0")
    assert lines[0] == "frozen 0 0"
    assert lines[-1] == "frozen cycle dropped later freed True"
