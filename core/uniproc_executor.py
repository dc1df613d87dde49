"""distributed_executor_backend="uni": the one worker runs inside the EngineCore process (vLLM's
UniProcExecutor), for a model on one device (tensor_parallel_size = pipeline_parallel_size = 1).

A step then crosses no socket on its way to the model and back: the busy loop calls the model
runner itself. With the worker in a process of its own ("mp"), each step goes over two ZMQ hops,
and at batch 1 a request's first token waits on both (the EngineCore to the worker, and back,
~0.2 ms each on an H100 host in benchmarks/timeline/request_timeline.py).

The steps in flight work as with "mp": submit() runs a step's host side (preparing it, launching
its forward), which returns as soon as the GPU has it queued, together with the outputs of the
steps it completed (their tokens held back as the worker holds them back: see ModelRunner);
receive_output() hands those out oldest first, and waits for the GPU only when none is ready. The
host work of the EngineCore and the model runner now take turns on one thread, while the GPU runs
the steps queued ahead.

What "mp" watches for, a worker process that dies or hangs, cannot happen apart from the engine
here: a failure inside the model runner is raised as WorkerDiedError with its traceback, which
ends the engine as a dead worker would (the step watchdog, execute_model_timeout_seconds, does not
apply: nothing outside the busy loop could time it).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from typing import Any

from minivllm.core.executor import WorkerDiedError
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class UniProcExecutor:
    """The executor interface (core/executor.py) over a Worker in this process."""

    hung = False  # (the step watchdog's flag in the ZMQ executors)

    def __init__(self, config: EngineConfig) -> None:
        # (EngineConfig.create refuses 'uni' with more than one device.)
        from minivllm.worker.worker import Worker, WorkerStepTimer  # imports torch: only this backend's engine

        self.worker = Worker(config, rank=0)
        self.runner = self.worker.model_runner
        self.outputs: deque[ModelRunnerOutput] = deque()  # completed steps' outputs, oldest first
        self.timer = WorkerStepTimer()
        self.last_step_end = time.perf_counter()
        logger.info("worker in the EngineCore process (distributed_executor_backend='uni')")

    @property
    def worker_pids(self) -> list[int]:
        return []  # no worker process: the EngineCore's pid is the one to watch

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [self._guarded(method, self.worker.call, method, list(args))]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.receive_output()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        start = time.perf_counter()
        gpu_wait_before = self.runner.gpu_wait_s
        self.outputs.extend(self._guarded("execute_model", self.runner.run_step, scheduler_output))
        end = time.perf_counter()
        # ("waiting for the next step" is here the EngineCore's own work between two steps)
        self.timer.add(start - self.last_step_end, end - start, self.runner.gpu_wait_s - gpu_wait_before)
        self.last_step_end = end

    def receive_output(self) -> ModelRunnerOutput:
        """The output of the oldest step submitted and not yet received."""
        if not self.outputs:  # its tokens are still held back: wait for them
            self.outputs.extend(self._guarded("execute_model", self.runner.finish_pending))
        if not self.outputs:
            raise WorkerDiedError("the model runner has no output for a step it was given")
        return self.outputs.popleft()

    def check_alive(self) -> None:
        pass  # the worker lives and dies with this process

    def shutdown(self) -> None:
        from minivllm.worker.distributed import destroy_distributed

        if self.timer.run_s:
            logger.info("worker 0 (in the EngineCore process): %s", self.timer)
        destroy_distributed(graphs_captured=self.runner.graphs is not None)

    def _guarded(self, method: str, function, *args: Any) -> Any:
        """function(*args), any failure turned into the WorkerDiedError a failed worker process gives."""
        try:
            return function(*args)
        except Exception:
            logger.exception("the worker failed in %s", method)
            raise WorkerDiedError(f"worker 0 (in the EngineCore process) failed in {method}:\n"
                                  f"{traceback.format_exc()}") from None
