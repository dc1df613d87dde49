"""Loaded by every Python process started with this directory on PYTHONPATH (request_timeline.py
starts the engine that way; its children inherit it): timestamps the calls named in TARGETS.

Each wrapped call logs its entry and exit with time.perf_counter() (CLOCK_MONOTONIC, the same clock
in every process) into a buffer, written to $TIMELINE_DIR/trace-<pid>.txt every 400 marks and when
the process ends. Nothing in minivllm is changed on disk: classes are patched as their modules are
imported, and a child's `runpy.run_module(module, "__main__")` becomes an import of the module (so
its classes are patched too) followed by its main().
"""

import atexit
import importlib
import importlib.abc
import importlib.util
import os
import runpy
import sys
import threading
import time

# module -> its functions or Class.methods to time
TARGETS = {
    "minivllm.frontend.llm": ["LLM._run"],
    "minivllm.frontend.core_client": ["EngineCoreClient._send", "EngineCoreClient._receive",
                                      "EngineCoreClient._on_message"],
    "minivllm.frontend.output_processor": ["OutputProcessor.process_outputs"],
    "minivllm.core.engine_core": ["EngineCoreProc._receive_frames", "EngineCoreProc._handle",
                                  "EngineCoreProc._send_outputs", "EngineCoreProc._send_to",
                                  "EngineCore.step_async", "EngineCoreProc._process_input"],
    "minivllm.core.scheduler": ["Scheduler.schedule", "Scheduler.update_from_output"],
    "minivllm.core.executor": ["ChannelExecutor.submit", "ChannelExecutor.receive_output"],
    "minivllm.core.uniproc_executor": ["UniProcExecutor.submit", "UniProcExecutor.receive_output"],
    "minivllm.worker.model_runner": ["ModelRunner.run_step", "ModelRunner.finish_pending",
                                     "ModelRunner._run_model", "ModelRunner._update_states"],
    "minivllm.worker.input_batch": ["InputBatch.prepare"],
    "minivllm.worker.cuda_graphs": ["StepGraphs.run", "run_forward"],
    "minivllm.worker.step_buffers": ["StepBuffers.load"],
    "minivllm.protocol.ipc": [],  # exit_without_teardown: write the buffer out first
}
TIMELINE_DIR = os.environ.get("TIMELINE_DIR")

if TIMELINE_DIR:
    _fd = os.open(os.path.join(TIMELINE_DIR, f"trace-{os.getpid()}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    _buffer: list = []

    def flush() -> None:
        pid = os.getpid()
        data = "".join(f"{t:.6f} {pid} {tid % 10000} {label}\n" for t, tid, label in _buffer)
        _buffer.clear()
        os.write(_fd, data.encode())

    def mark(label: str) -> None:
        # In memory: a write per mark cost 15-100 us on the hosts tried.
        _buffer.append((time.perf_counter(), threading.get_ident(), label))
        if len(_buffer) >= 400:
            flush()

    atexit.register(flush)

    def timed(fn, name: str):
        def wrapper(*args, **kwargs):
            mark(f"> {name}")
            try:
                return fn(*args, **kwargs)
            finally:
                mark(f"< {name}")
        wrapper.__name__ = getattr(fn, "__name__", name)
        return wrapper

    def patch(module) -> None:
        if module.__name__ == "minivllm.protocol.ipc":  # workers and engines end with os._exit
            exit_without_teardown = module.exit_without_teardown

            def exit_flushed(code: int) -> None:
                flush()
                exit_without_teardown(code)
            module.exit_without_teardown = exit_flushed
        for path in TARGETS[module.__name__]:
            *owner_path, attr = path.split(".")
            owner = module
            for name in owner_path:
                owner = getattr(owner, name)
            setattr(owner, attr, timed(getattr(owner, attr), path))

    class PatchingFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in TARGETS:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(module):
                    exec_module(module)
                    patch(module)
                spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, PatchingFinder())
    _run_module = runpy.run_module

    def run_module(module, run_name=None, alter_sys=False, **kwargs):
        if module in TARGETS and run_name == "__main__":
            return importlib.import_module(module).main()
        return _run_module(module, run_name=run_name, alter_sys=alter_sys, **kwargs)

    runpy.run_module = run_module
    import builtins
    builtins.__timeline_mark__ = mark  # for the driver's own marks
