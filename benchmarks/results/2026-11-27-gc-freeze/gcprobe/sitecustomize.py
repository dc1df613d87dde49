"""Probe only: every Python process started with this directory on PYTHONPATH records its garbage
collector's passes (gc.callbacks) and prints, at exit, how many of each generation ran and how long
they took (the largest too), tagged with the process's role (its argv) and pid."""
import atexit, gc, os, sys, time

_starts: dict = {}
_passes: list = []  # (generation, seconds, collected, time since start)
_t0 = time.perf_counter()


def _callback(phase, info):
    if phase == "start":
        _starts["t"] = time.perf_counter()
    else:
        t = time.perf_counter()
        sec = t - _starts.get("t", t)
        _passes.append((info["generation"], sec, info.get("collected", 0), t - _t0))
        if sec > 0.002:
            print(f"GCPROBE pid {os.getpid()} gen{info['generation']} pass {sec * 1e3:.1f} ms at {time.time() % 1000:.2f}",
                  file=sys.stderr, flush=True)


gc.callbacks.append(_callback)


def _report():
    if not _passes:
        return
    role = " ".join(os.path.basename(a) for a in sys.argv[:3])[:60]
    by_gen = {}
    for gen, sec, _, _ in _passes:
        n, total, worst = by_gen.get(gen, (0, 0.0, 0.0))
        by_gen[gen] = (n + 1, total + sec, max(worst, sec))
    summary = "; ".join(f"gen{g}: {n} passes, {total * 1e3:.1f} ms, max {worst * 1e3:.2f} ms"
                        for g, (n, total, worst) in sorted(by_gen.items()))
    big = [f"{sec * 1e3:.1f}ms@{at:.1f}s(g{gen})" for gen, sec, _, at in _passes if sec > 0.002]
    print(f"GCPROBE pid {os.getpid()} [{role}] {summary}; over 2 ms: {big[:30]}", file=sys.stderr, flush=True)


atexit.register(_report)
