"""Probe only: where the EngineCore's busy loop spends an iteration that runs long.

Every Python process started with this directory on PYTHONPATH loads it. It loads
benchmarks/gpu_idle/sitecustomize.py by path (so a worker profiles its GPU as gpu_idle.py's runs do,
when MINIVLLM_GPU_IDLE_STEPS is set) and, in the process that imports minivllm.core.engine_core,
times each busy-loop iteration by part: input handling, schedule, submit, the wait for a step's
output, the update, sending outputs, deferred block updates, and the collector's passes (with their
generation). An iteration whose time not waiting for output is over MINIVLLM_PROBE_LONG_MS (default 3) is printed with its wall-clock
time, once the engine has seen a step of more than 8 new requests (bench's warm-up sends 8).
The worker prints its profiler's wall-clock start, so its GPU gaps can be set beside these lines."""
import gc
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_GPU_IDLE = os.path.join(_HERE, "..", "..", "..", "gpu_idle", "sitecustomize.py")
_gpu_idle: dict = {"__name__": "gpu_idle_sitecustomize", "__file__": _GPU_IDLE}
exec(compile(open(_GPU_IDLE).read(), _GPU_IDLE, "exec"), _gpu_idle)

LONG_S = float(os.environ.get("MINIVLLM_PROBE_LONG_MS", "3")) / 1e3
_parts: dict = {}
_state = {"start": None, "armed": False, "printed": 0, "gc_start": 0.0, "gc": []}


def _timed(name, function):
    def call(*args, **kwargs):
        t = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _parts[name] = _parts.get(name, 0.0) + time.perf_counter() - t
    return call


def _gc_callback(phase, info):
    if phase == "start":
        _state["gc_start"] = time.perf_counter()
    else:
        _state["gc"].append((info["generation"], time.perf_counter() - _state["gc_start"]))


def _iteration_boundary():
    now = time.perf_counter()
    start = _state["start"]
    # The wait for a step's output is the GPU's time, not the loop's: only the rest counts as long.
    busy = now - start - _parts.get("receive_output", 0.0) if start is not None else 0.0
    if _state["armed"] and busy > LONG_S and _state["printed"] < 300:
        _state["printed"] += 1
        parts = " ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(_parts.items(), key=lambda kv: -kv[1]) if v > 1e-4)
        passes = " ".join(f"g{g}:{s * 1e3:.2f}" for g, s in _state["gc"])
        print(f"HOSTGAP engine iteration {(now - start) * 1e3:.2f} ms ({busy * 1e3:.2f} not waiting) ending at wall {time.time():.4f}: {parts}"
              f"{' | gc ' + passes if passes else ''}", file=sys.stderr, flush=True)
    _parts.clear()
    _state["gc"].clear()
    _state["start"] = now


def _patch_engine_loop(proc) -> None:
    process_input = proc._process_input

    def boundary_then_input(self, block):
        _iteration_boundary()
        return _timed("input", process_input)(self, block)

    proc._process_input = boundary_then_input
    proc._send_outputs = _timed("send_outputs", proc._send_outputs)


def _patch_scheduler(module):
    # The EngineCore runs as `python -m minivllm.core.engine_core`, so its classes live in __main__,
    # defined after this import; the first Scheduler built (inside EngineCoreProc.__init__) patches them.
    init = module.Scheduler.__init__

    def patched_init(sched, *args, **kwargs):
        init(sched, *args, **kwargs)
        main = sys.modules.get("__main__")
        proc = getattr(main, "EngineCoreProc", None)
        if proc is None or getattr(proc, "_hostgap_patched", False):
            return
        proc._hostgap_patched = True
        _patch_engine_loop(proc)
        schedule = sched.schedule

        def schedule_and_arm():
            out = schedule()
            if len(out.scheduled_new_reqs) > 8:
                _state["armed"] = True
            return out

        sched.schedule = _timed("schedule", schedule_and_arm)
        sched.update_from_output = _timed("update", sched.update_from_output)
        sched.apply_deferred_block_updates = _timed("deferred_blocks", sched.apply_deferred_block_updates)
        gc.callbacks.append(_gc_callback)

    module.Scheduler.__init__ = patched_init


def _patch_executor(module):
    for cls in (module.ChannelExecutor,):
        for name in ("submit", "receive_output"):
            setattr(cls, name, _timed(name, getattr(cls, name)))


def _patch_worker_wall_clock(module):
    # gpu_idle's profiler starts inside run_step; its kernels' times count from about then.
    import torch.profiler as tp
    enter = tp.profile.__enter__

    def enter_and_say(self):
        print(f"HOSTGAP worker profiler starts at wall {time.time():.4f}", file=sys.stderr, flush=True)
        return enter(self)

    tp.profile.__enter__ = enter_and_say


sys.meta_path.insert(0, _gpu_idle["PatchOnImport"]("minivllm.core.scheduler", _patch_scheduler))
sys.meta_path.insert(0, _gpu_idle["PatchOnImport"]("minivllm.core.executor", _patch_executor))
if os.environ.get("MINIVLLM_GPU_IDLE_STEPS"):
    sys.meta_path.insert(0, _gpu_idle["PatchOnImport"]("minivllm.worker.model_runner", _patch_worker_wall_clock))
