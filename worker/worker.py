"""The worker process: one per GPU. It owns the device, the model and the KV cache.

Loop: receive a message from the EngineCore, act, answer. A SchedulerOutput runs one model step
(only rank 0 answers with the sampled tokens -- TP rank 0 of the last stage under pipeline parallelism; on CUDA a step's answer goes out once the next step
is launched, or as soon as its tokens are ready when no next step is queued: see ModelRunner); a WorkerCall runs one of the few methods listed in
Worker.CALLABLE; Shutdown ends the loop. Any failure is reported with its traceback, then the
process exits, so the EngineCore can turn it into a clear error.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import traceback
from collections import deque
from typing import Any

import msgspec
import zmq

from minivllm.protocol.channels import ChannelClosed, open_worker_channels
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.gc_heap import freeze_gc_heap
from minivllm.protocol.ipc import exit_without_teardown
from minivllm.protocol.messages import (DeferredStart, ModelRunnerOutput, SchedulerOutput, Shutdown, WorkerCall,
                                        WorkerReply)
from minivllm.protocol.serial import encode, worker_input_decoder

logger = logging.getLogger(__name__)

_PENDING_POLL_S = 20e-6
_PENDING_SPIN_S = 5e-3


class WorkerStepTimer:
    """Per step (medians, logged at shutdown): the time in run_step, the part of it spent waiting
    for the GPU (the previous step's tokens), and the time waiting for the next step to arrive.
    Which of the three is large says whether a step is bound by the GPU, by this process's host
    work, or by the EngineCore and the sockets."""

    def __init__(self) -> None:
        self.run_s: deque[float] = deque(maxlen=1 << 16)
        self.gpu_wait_s: deque[float] = deque(maxlen=1 << 16)
        self.recv_wait_s: deque[float] = deque(maxlen=1 << 16)

    def add(self, recv_wait_s: float, run_s: float, gpu_wait_s: float) -> None:
        self.recv_wait_s.append(recv_wait_s)
        self.run_s.append(run_s)
        self.gpu_wait_s.append(gpu_wait_s)

    def __str__(self) -> str:
        median = lambda values: 1000 * statistics.median(values)  # noqa: E731
        return (f"{len(self.run_s)} steps, per step (medians): run_step {median(self.run_s):.3f} ms, of which "
                f"waiting for the GPU {median(self.gpu_wait_s):.3f} ms; waiting for the next step "
                f"{median(self.recv_wait_s):.3f} ms")


class Worker:
    CALLABLE = ("determine_num_blocks", "initialize_cache")

    def __init__(self, config: EngineConfig, rank: int, dist_init_address: str | None = None,
                 device_index: int | None = None) -> None:
        """device_index: which of the visible CUDA devices is this worker's (default: its rank; a
        Ray actor sees only the one GPU Ray gave it, so 0)."""
        # These import torch: after the sockets are up.
        from minivllm.worker.distributed import init_distributed
        from minivllm.worker.model_runner import ModelRunner, resolve_device

        self.rank = rank
        world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        device_index = rank if device_index is None else device_index
        device = resolve_device(config.device, device_index)
        if device.type == "cpu":
            from minivllm.worker.cpu_malloc import keep_freed_memory

            keep_freed_memory()  # (each activation is a fresh allocation there: worker/cpu_malloc.py)
        # Data-parallel engines' workers share the host's cores too (when they run on the CPU).
        processes_on_cpu = world_size * config.data_parallel_size
        if world_size > 1 or processes_on_cpu > 1:
            import torch

            if device.type == "cuda":
                torch.cuda.set_device(device)  # before NCCL makes its communicator on it
            else:  # the ranks share the host's cores: a thread pool each the size of all would thrash
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes_on_cpu))
        init_distributed(rank, config.tensor_parallel_size, dist_init_address, device,  # before the model: layers read it
                         config.pipeline_parallel_size)
        self.model_runner = ModelRunner(config, device_index)  # its `rank` picks the CUDA device

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_cache(num_blocks)

    def call(self, method: str, args: list[Any]) -> Any:
        if method not in self.CALLABLE:
            raise ValueError(f"unknown worker method {method!r}; allowed: {', '.join(self.CALLABLE)}")
        return getattr(self, method)(*args)


def run_worker(config: EngineConfig, rank: int, work_address: str, result_address: str,
               dist_init_address: str | None = None, device_index: int | None = None,
               curve_secret: str | None = None) -> int:
    """Serve the executor until Shutdown; returns the exit code. curve_secret: the executor's key
    when its sockets are TCP (workers on other nodes), see core/executor.py."""
    ctx = zmq.Context()
    work, results = open_worker_channels(ctx, work_address, result_address, curve_secret)

    def reply(method: str, result: Any = None, error: str | None = None) -> None:
        results.send(encode(WorkerReply(rank, method, result, error)), wait=True)

    # TP rank 0 of the last pipeline stage (rank = pp_rank * tp + tp_rank; rank 0 without PP).
    answers = rank == (config.pipeline_parallel_size - 1) * config.tensor_parallel_size

    def send_outputs(outputs: list[ModelRunnerOutput]) -> None:
        if answers:  # the ranks compute the same tokens; one answers
            for output in outputs:
                results.send(encode(output), wait=True)

    def send_when_ready_or_next_step_arrives() -> None:
        """A step's tokens are held back while the next step is on its way (see ModelRunner);
        with no step queued, send them as soon as they reach the host, unless one arrives first.
        The first _PENDING_SPIN_S of the wait spin: a batch-1 step's tokens come within a
        millisecond or two, and a sleep of 20 us takes ~75 on the GPU hosts (timer slack)."""
        spin_until = time.perf_counter() + _PENDING_SPIN_S
        while not work.poll(0):
            if runner.pending_ready():
                send_outputs(runner.finish_pending())
                return
            if time.perf_counter() > spin_until:
                time.sleep(_PENDING_POLL_S)

    method = "ready"
    try:
        worker = Worker(config, rank, dist_init_address, device_index)
        runner = worker.model_runner
        reply("ready", os.getpid())
        timer = WorkerStepTimer()
        while True:
            t0 = time.perf_counter()
            if runner.has_pending():
                send_when_ready_or_next_step_arrives()
            message = worker_input_decoder.decode(work.recv())
            if isinstance(message, SchedulerOutput):
                method = "execute_model"
                t1 = time.perf_counter()
                gpu_wait_before = runner.gpu_wait_s
                outputs = runner.run_step(message)
                timer.add(t1 - t0, time.perf_counter() - t1, runner.gpu_wait_s - gpu_wait_before)
                send_outputs(outputs)
            elif isinstance(message, WorkerCall):
                method = message.method
                result = worker.call(method, message.args)
                if method == "initialize_cache":  # the last of start-up: the model, its cache and graphs are built
                    freeze_gc_heap(f"worker {rank}")
                reply(method, result)
            elif isinstance(message, Shutdown):
                from minivllm.worker.distributed import destroy_distributed

                if timer.run_s:
                    logger.info("worker %d: %s", rank, timer)
                # Every rank got Shutdown: none is left inside a collective.
                destroy_distributed(graphs_captured=worker.model_runner.graphs is not None)
                return 0
    except ChannelClosed:  # (a local worker's socket pair: the EngineCore is gone, nobody to tell)
        logger.warning("worker %d: the EngineCore closed its channel; exiting", rank)
        return 1
    except Exception:
        logger.exception("worker %d failed in %s", rank, method)
        reply(method, error=traceback.format_exc())
        return 1
    finally:
        ctx.destroy(linger=1000)


def read_deferred_start() -> DeferredStart | None:
    """Import the model code (torch with it: the ~2-3 s a worker's start spends importing), then
    wait for the start message on stdin; None if stdin closes empty (the engine is not going to
    use this worker)."""
    from minivllm.worker import model_runner  # noqa: F401  (imported for its import time)

    data = sys.stdin.buffer.read()
    return msgspec.json.decode(data, type=DeferredStart) if data else None


def main() -> None:
    parser = argparse.ArgumentParser(description="minivllm worker process (started by the EngineCore)")
    config_source = parser.add_mutually_exclusive_group(required=True)
    config_source.add_argument("--config", help="EngineConfig as JSON")
    config_source.add_argument("--config-stdin", action="store_true",
                               help="read the config (a DeferredStart, JSON) from stdin, once the engine has it")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--work-address", required=True)
    parser.add_argument("--result-address", required=True)
    parser.add_argument("--dist-init-address", default=None, help="torch.distributed rendezvous (TP > 1)")
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("MINIVLLM_LOG_LEVEL", "INFO"),
                        format=f"%(levelname)s %(asctime)s [worker{args.rank}] %(name)s: %(message)s")
    if args.config is not None:
        config, dist_init_address = msgspec.json.decode(args.config, type=EngineConfig), args.dist_init_address
    else:
        start = read_deferred_start()
        if start is None:
            exit_without_teardown(0)
        config, dist_init_address = start.config, start.dist_init_address
    code = run_worker(config, args.rank, args.work_address, args.result_address, dist_init_address)
    # The sockets (and any process group) are closed; every engine shutdown waits for this exit.
    exit_without_teardown(code)


if __name__ == "__main__":
    main()
