"""Loaded by every Python process started with this directory on PYTHONPATH (gpu_idle.py does):
in the process that imports minivllm.worker.model_runner, wrap ModelRunner so that it profiles the
GPU's kernels over MINIVLLM_GPU_IDLE_STEPS steps and prints where the GPU sat idle."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TARGET = "minivllm.worker.model_runner"
HOST_CALLS = ("_update_states", "_run_model", "finish_pending", "_sample")  # named in the report


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Calls patch(module) once `target` is imported and executed, in whatever process imports it (other
    probes' sitecustomize files load this file by path for it)."""

    def __init__(self, target: str, patch) -> None:
        self.target, self.patch = target, patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)  # find the real module, then wrap its loader
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        spec.loader = _PatchingLoader(spec.loader, self.patch)
        return spec


def _patch(runner_class) -> None:
    import torch
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    steps, min_new = int(os.environ["MINIVLLM_GPU_IDLE_STEPS"]), int(os.environ.get("MINIVLLM_GPU_IDLE_MIN_NEW", "8"))
    skip = int(os.environ.get("MINIVLLM_GPU_IDLE_SKIP", "0"))  # steps after the first measured one, unprofiled
    state: dict = {"profiler": None, "done": 0, "steps": [], "started": False, "skipped": 0}

    def named(name: str, function):
        def call(*args, **kwargs):
            with record_function("host:" + name):
                return function(*args, **kwargs)
        return call

    for name in HOST_CALLS:
        setattr(runner_class, name, named(name, getattr(runner_class, name)))
    run_step = runner_class.run_step

    def profiled_run_step(self, scheduler_output):
        if not state["started"] and len(scheduler_output.scheduled_new_reqs) > min_new:
            state["started"] = True
        if state["started"] and state["profiler"] is None and not state["done"]:
            if state["skipped"] < skip:
                state["skipped"] += 1
            else:
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
                state["profiler"] = profile(activities=activities)
                state["profiler"].__enter__()
        with record_function("host:run_step"):
            outputs = run_step(self, scheduler_output)
        if state["profiler"] is not None:
            new_requests = len(scheduler_output.scheduled_new_reqs)
            state["steps"].append((new_requests, scheduler_output.total_num_scheduled_tokens))
            if len(state["steps"]) == steps:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                profiler, state["profiler"], state["done"] = state["profiler"], None, 1
                profiler.__exit__(None, None, None)
                report(profiler.events(), state["steps"])
        return outputs

    runner_class.run_step = profiled_run_step


def report(events, steps: list) -> None:
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if "CUDA" in str(e.device_type))
    host = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                  if "CUDA" not in str(e.device_type) and e.name.startswith("host:"))
    calls = {name: sum(1 for *_, n in host if n == "host:" + name) for name in ("run_step", *HOST_CALLS)}
    print("GPU_IDLE host calls seen:", calls, flush=True)
    print("GPU_IDLE steps (new requests, tokens):", steps, flush=True)
    if not kernels:
        print("GPU_IDLE no GPU kernels recorded (not a CUDA run)", flush=True)
        return
    gaps, busy = [], 0.0
    start, end = kernels[0][0], kernels[0][1]
    for s, e, name in kernels[1:]:
        if s > end:
            busy += end - start
            gaps.append((s - end, end, name))
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    span = end - kernels[0][0]
    by_name: dict[str, list[float]] = {}
    for s, e, name in kernels:
        entry = by_name.setdefault(name[:70], [0, 0.0])
        entry[0] += 1
        entry[1] += e - s
    total = sum(t for _, t in by_name.values())
    print(f"GPU_IDLE kernel time by name ({total / 1e3:.1f} ms in all):", flush=True)
    for name, (count, spent) in sorted(by_name.items(), key=lambda item: -item[1][1])[:40]:
        print(f"GPU_IDLE   {spent / 1e3:9.2f} ms {count:6d}x  {name}", flush=True)
    print(f"GPU_IDLE {len(steps)} steps: GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle "
          f"{(span - busy) / 1e3:.1f} ms ({sum(g for g, _, _ in gaps if g > 1000) / 1e3:.1f} ms in gaps over 1 ms)",
          flush=True)
    for gap, at, before in sorted(gaps, reverse=True)[:5]:
        print(f"GPU_IDLE gap {gap:.0f} us at {(at - kernels[0][0]) / 1e3:.1f} ms, before {before[:50]}; the host:",
              flush=True)
        for s, e, name in host:
            if e >= at - 2000 and s <= at + gap:
                print(f"GPU_IDLE     {name:22s} {(s - at) / 1e3:+8.3f} .. {(e - at) / 1e3:+8.3f} ms "
                      "from the gap's start", flush=True)


if os.environ.get("MINIVLLM_GPU_IDLE_STEPS"):
    sys.meta_path.insert(0, PatchOnImport(TARGET, lambda module: _patch(module.ModelRunner)))
