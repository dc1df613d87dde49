"""The EngineCore process: the scheduler's busy loop between frontends and workers.

    frontends --ROUTER socket--> input thread --queue--> busy loop --queue--> output thread
                                  (decode)               schedule()           (encode)
                                                         executor.execute_model()
                                                         update_from_output()

With async scheduling (the default) the busy loop keeps the workers a step ahead: it submits step
N+1 and only then waits for step N's tokens (EngineCore.step_async).

The busy loop never touches a socket: the input thread owns the ROUTER socket (ZMQ sockets are
single-threaded) and decodes what arrives; the output thread encodes replies and hands the bytes to
the input thread through an in-process socket. So (de)serialization overlaps the model step.
Several frontends may be attached at once; each request's outputs go back to the frontend that
sent it.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import threading
import time
from collections import deque
from typing import Any, Callable

import msgspec
import zmq

from minivllm.core.executor import Executor, WorkerDiedError
from minivllm.core.scheduler import Scheduler
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.ipc import remove_ipc_file
from minivllm.protocol.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FINISH_ABORT,
    EngineInfo,
    EngineStats,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from minivllm.protocol.serial import encode, engine_input_decoder

logger = logging.getLogger(__name__)

_OUTBOX = "inproc://engine-core-outbox"
_IDLE_WAIT_S = 1.0  # how often an idle engine checks its workers are alive
# Seconds between stats lines while the engine is busy (0: never log them on a timer).
STATS_INTERVAL_ENV = "MINIVLLM_STATS_INTERVAL"
DEFAULT_STATS_INTERVAL_S = 5.0


class StatsLogger:
    """The periodic "Avg prompt throughput ..." line, from EngineStats snapshots: gauges as they
    are now, throughputs over the time since the previous line."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.last_time = time.monotonic()
        self.last_stats: EngineStats | None = None

    def due(self) -> bool:
        return self.interval_s > 0 and time.monotonic() - self.last_time >= self.interval_s

    def log(self, stats: EngineStats, force: bool = False) -> None:
        """Log a line if anything happened since the last one (or `force`)."""
        now = time.monotonic()
        last = self.last_stats
        prefill = stats.num_prefill_tokens - (last.num_prefill_tokens if last else 0)
        generation = stats.num_generation_tokens - (last.num_generation_tokens if last else 0)
        idle = not (prefill or generation or stats.num_running_reqs or stats.num_waiting_reqs)
        elapsed = max(now - self.last_time, 1e-9)
        self.last_time, self.last_stats = now, stats
        if idle and not force:
            return
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
            "Preemptions: %d",
            prefill / elapsed, generation / elapsed, stats.num_running_reqs, stats.num_waiting_reqs,
            100 * stats.kv_cache_usage, 100 * stats.prefix_cache_hit_rate, stats.num_preemptions,
        )


class StepTimer:
    """Where the busy loop's time goes: scheduling, waiting for the workers, turning tokens into outputs."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.schedule_s = self.execute_s = self.update_s = 0.0

    def add(self, schedule_s: float, execute_s: float, update_s: float) -> None:
        self.num_steps += 1
        self.schedule_s += schedule_s
        self.execute_s += execute_s
        self.update_s += update_s

    def __str__(self) -> str:
        per_step = lambda total: 1000 * total / self.num_steps  # noqa: E731
        return (f"{self.num_steps} steps, per step: schedule {per_step(self.schedule_s):.2f} ms, "
                f"workers {per_step(self.execute_s):.2f} ms, update {per_step(self.update_s):.2f} ms")


class EngineCore:
    """Scheduler + executor, one step at a time. No sockets: EngineCoreProc adds those."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = Executor(config)
        try:
            if config.num_gpu_blocks is not None:
                num_gpu_blocks = config.num_gpu_blocks
            else:  # every rank must hold the cache: the smallest answer wins
                num_gpu_blocks = min(self.executor.collective_rpc("determine_num_blocks"))
            self.executor.collective_rpc("initialize_cache", num_gpu_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.num_gpu_blocks = num_gpu_blocks
        self.scheduler = Scheduler(config, num_gpu_blocks)
        # Async scheduling: steps sent to the workers whose tokens have not come back, oldest first.
        self.steps_in_flight: deque[SchedulerOutput] = deque()
        self.step_timer = StepTimer()
        capacity = num_gpu_blocks * config.block_size
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens); max_model_len %d; %s scheduling; prefix caching %s",
            num_gpu_blocks, config.block_size, capacity, config.max_model_len, config.scheduling_policy,
            "on" if config.enable_prefix_caching else "off",
        )
        if config.max_model_len > capacity:
            # Not fatal: short requests still run. Requests that could outgrow the cache are
            # rejected at admission (they would otherwise wait, or preempt themselves, forever).
            logger.warning(
                "max_model_len=%d is more than the KV cache holds (%d tokens): requests whose prompt + "
                "max_tokens exceeds %d tokens will be rejected. Lower max_model_len or give more KV cache.",
                config.max_model_len, capacity, capacity,
            )
        self.stats_logger = StatsLogger(float(os.environ.get(STATS_INTERVAL_ENV, DEFAULT_STATS_INTERVAL_S)))

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.steps_in_flight)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and turn its tokens into outputs."""
        if self.config.async_scheduling:
            return self.step_async()
        if not self.scheduler.has_unfinished_requests():
            return []
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        t1 = time.perf_counter()
        if scheduler_output.total_num_scheduled_tokens > 0:
            model_output = self.executor.execute_model(scheduler_output)
        else:
            model_output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.step_timer.add(t1 - t0, t2 - t1, time.perf_counter() - t2)
        return outputs

    def step_async(self) -> list[EngineCoreOutput]:
        """Keep the workers one step ahead: schedule and submit step N+1, then wait for step N's
        tokens and turn them into outputs while the workers already run N+1. The scheduler counts
        N's tokens as placeholders meanwhile; the workers have them by the time they run N+1."""
        t0 = time.perf_counter()
        submitted = False
        if self.scheduler.has_unfinished_requests() and len(self.steps_in_flight) < 2:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens > 0:
                self.executor.submit(scheduler_output)
                self.steps_in_flight.append(scheduler_output)
                submitted = True
            else:  # nothing runnable until a step in flight reports (or ever, if none is)
                empty = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
                outputs = self.scheduler.update_from_output(scheduler_output, empty)
                if not self.steps_in_flight:
                    return outputs
        t1 = time.perf_counter()
        if not self.steps_in_flight or (submitted and len(self.steps_in_flight) < 2):
            return []  # the pipeline is filling: schedule the next step first
        scheduler_output = self.steps_in_flight.popleft()
        model_output = self.executor.receive_output()
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.step_timer.add(t1 - t0, t2 - t1, time.perf_counter() - t2)
        return outputs

    def get_engine_info(self) -> EngineInfo:
        c = self.config
        return EngineInfo(
            model=c.model, tokenizer=c.tokenizer, max_model_len=c.max_model_len, vocab_size=c.vocab_size,
            eos_token_ids=c.eos_token_ids, block_size=c.block_size, num_gpu_blocks=self.num_gpu_blocks,
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            engine_pid=os.getpid(), worker_pids=self.executor.worker_pids,
            scheduling_policy=c.scheduling_policy, enable_prefix_caching=c.enable_prefix_caching,
        )

    def get_stats(self) -> EngineStats:
        return self.scheduler.make_stats()

    def log_stats(self) -> None:
        """Log the stats line now (throughputs since the previous line)."""
        self.stats_logger.log(self.get_stats(), force=True)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        if self.step_timer.num_steps:
            logger.info("%s", self.step_timer)
        self.executor.shutdown()


class EngineCoreProc(EngineCore):
    """An EngineCore serving frontends at a ZMQ address until told to stop."""

    def __init__(self, config: EngineConfig, address: str) -> None:
        super().__init__(config)
        self.address = address
        self.input_queue: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[bytes, EngineCoreOutputs] | None] = queue.Queue()
        self.request_owner: dict[str, bytes] = {}  # request id -> identity of the frontend that sent it
        self.clients: set[bytes] = set()
        self.stopping = threading.Event()
        self.utilities: dict[str, Callable[..., Any]] = {
            "get_engine_info": self.get_engine_info,
            "check_health": lambda: True,
            "get_num_unfinished_requests": self.scheduler.get_num_unfinished_requests,
            "get_stats": self.get_stats,
            "log_stats": self.log_stats,
            "reset_prefix_cache": self.reset_prefix_cache,
        }
        self.ctx = zmq.Context()
        bound = threading.Event()
        self.input_thread = threading.Thread(target=self._serve_socket, args=(bound,), name="input", daemon=True)
        self.output_thread = threading.Thread(target=self._encode_outputs, name="output", daemon=True)
        self.input_thread.start()
        self.output_thread.start()
        bound.wait()
        logger.info("EngineCore serving at %s", address)

    # -- the busy loop ---------------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        try:
            while not self.stopping.is_set():
                self._process_input(block=not self.has_work())
                outputs = self.step()
                if outputs:
                    self._send_outputs(outputs)
                if self.stats_logger.due():
                    self.stats_logger.log(self.get_stats())
        except WorkerDiedError as e:
            logger.error("engine dead: %s", e)
            for client in self.clients:
                self.output_queue.put((client, EngineCoreOutputs(engine_dead=str(e))))
            raise
        finally:
            self.output_queue.put(None)
            self.output_thread.join(timeout=5)
            self.stopping.set()
            self.input_thread.join(timeout=5)
            self.ctx.destroy(linger=0)
            remove_ipc_file(self.address)
            self.shutdown()

    def _process_input(self, block: bool) -> None:
        """Handle everything that arrived; when idle, wait (checking the workers now and then)."""
        while True:
            try:
                identity, message = self.input_queue.get(block=block, timeout=_IDLE_WAIT_S if block else None)
            except queue.Empty:
                if not block or self.stopping.is_set():
                    return
                self.executor.check_alive()
                if self.stats_logger.due():  # the last busy interval's line
                    self.stats_logger.log(self.get_stats())
                continue
            self._handle(identity, message)
            block = False

    def _handle(self, identity: bytes, message: Any) -> None:
        self.clients.add(identity)
        if isinstance(message, EngineCoreRequest):
            self.request_owner[message.request_id] = identity
            try:
                self.add_request(message)
            except Exception as e:  # frontends validate first; whatever slips through fails alone
                if isinstance(e, ValueError):  # a bad request (e.g. too long for the KV cache)
                    logger.error("rejected request %s: %s", message.request_id, e)
                else:
                    logger.exception("rejected request %s", message.request_id)
                self._send_outputs([EngineCoreOutput(message.request_id, [], finish_reason=FINISH_ABORT)])
        elif isinstance(message, AbortRequests):
            outputs = self.abort_requests(message.request_ids)
            if outputs:
                self._send_outputs(outputs)
        elif isinstance(message, UtilityCall):
            self.output_queue.put((identity, EngineCoreOutputs(utility_result=self._call_utility(message))))
        elif isinstance(message, Shutdown):
            logger.info("shutdown requested")
            self.stopping.set()

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        fn = self.utilities.get(call.method)
        if fn is None:
            return UtilityResult(call.call_id, error=f"unknown utility {call.method!r}; "
                                 f"allowed: {', '.join(self.utilities)}")
        try:
            return UtilityResult(call.call_id, result=fn(*call.args))
        except Exception as e:  # a bad utility call must not take the engine down
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        by_client: dict[bytes, list[EngineCoreOutput]] = {}
        for out in outputs:
            owner = self.request_owner.get(out.request_id)
            if out.finish_reason is not None:
                self.request_owner.pop(out.request_id, None)
            if owner is not None:
                by_client.setdefault(owner, []).append(out)
        for owner, outs in by_client.items():
            self.output_queue.put((owner, EngineCoreOutputs(outputs=outs)))

    # -- the I/O threads -------------------------------------------------------------------------

    def _serve_socket(self, bound: threading.Event) -> None:
        """Own the ROUTER socket: decode what frontends send, forward what the output thread encoded."""
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 1000)
        router.bind(self.address)
        outbox = self.ctx.socket(zmq.PULL)
        outbox.bind(_OUTBOX)
        bound.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(outbox, zmq.POLLIN)
        while not self.stopping.is_set() or outbox.poll(0):
            events = dict(poller.poll(100))
            if router in events:
                identity, payload = router.recv_multipart()
                try:
                    self.input_queue.put((identity, engine_input_decoder.decode(payload)))
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    logger.warning("dropped a malformed message from a frontend: %s", e)
            if outbox in events:
                router.send_multipart(outbox.recv_multipart())
        router.close()
        outbox.close()

    def _encode_outputs(self) -> None:
        outbox = self.ctx.socket(zmq.PUSH)
        outbox.connect(_OUTBOX)
        while (item := self.output_queue.get()) is not None:
            identity, outputs = item
            outbox.send_multipart([identity, encode(outputs)])
        outbox.close(linger=1000)


def run_engine_core(config: EngineConfig, address: str) -> None:
    """Start an EngineCore at `address` and serve until Shutdown, SIGTERM or SIGINT."""
    engine = EngineCoreProc(config, address)

    def stop(signum: int, _frame: Any) -> None:
        logger.info("received signal %d, shutting down", signum)
        engine.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    engine.run_busy_loop()


def main() -> None:
    parser = argparse.ArgumentParser(description="minivllm EngineCore process (started by a frontend)")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--address", required=True, help="ZMQ address to serve frontends at")
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("MINIVLLM_LOG_LEVEL", "INFO"),
                        format="%(levelname)s %(asctime)s [engine] %(name)s: %(message)s")
    config = msgspec.json.decode(args.config, type=EngineConfig)
    try:
        run_engine_core(config, args.address)
    except WorkerDiedError:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
