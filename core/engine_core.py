"""The EngineCore process: the scheduler's busy loop between frontends and workers.

    frontends --ROUTER socket--> input thread --queue--> busy loop --inproc socket--> input thread
                                  (decode)               schedule()                    (to the frontend)
                                                         executor.execute_model()
                                                         update_from_output(), encode

With async scheduling (the default) the busy loop keeps the workers a step ahead: it submits step
N+1 and only then waits for step N's tokens (EngineCore.step_async).

The input thread owns the ROUTER socket (ZMQ sockets are single-threaded) and decodes and checks
what arrives; the busy loop encodes its replies and pushes the bytes to the input thread through an
in-process socket of its own, and the input thread sends them on.
Several frontends may be attached at once; each request's outputs go back to the frontend that
sent it. The socket is untrusted input: see EngineCoreProc.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from minivllm.core.executor import PrestartedWorker, WorkerDiedError, make_executor
from minivllm.core.scheduler import Scheduler
from minivllm.protocol.auth import (
    HANDSHAKE_FAILED_EVENTS,
    HANDSHAKE_FAILURES,
    CurveKeys,
    check_bind_allowed,
    start_client_key_authenticator,
)
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.gc_heap import freeze_gc_heap
from minivllm.protocol.ipc import remove_ipc_file
from minivllm.protocol.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ERROR_INVALID,
    ERROR_OVERLOADED,
    FINISH_ABORT,
    EngineInfo,
    EngineStats,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from minivllm.protocol.serial import RawAddRequests, encode, engine_socket_decoder, request_decoder
from minivllm.protocol.validation import (
    MAX_REQUEST_ID_LENGTH,
    WIRE_REQUEST_ID_OVERHEAD,
    EngineLimits,
    validate_request,
)

logger = logging.getLogger(__name__)

_OUTBOX = "inproc://engine-core-outbox"
_IDLE_WAIT_S = 1.0  # how often an idle engine checks its workers are alive
# Block bookkeeping of at least this many blocks waits until the socket thread has sent the step's
# outputs (_let_socket_thread_send), for at most _HANDOFF_WAIT_S.
_HANDOFF_MIN_BLOCKS = 256
_HANDOFF_WAIT_S = 0.002
# Seconds between stats lines while the engine is busy (0: never log them on a timer).
STATS_INTERVAL_ENV = "MINIVLLM_STATS_INTERVAL"
STEPS_IN_FLIGHT_ENV = "MINIVLLM_STEPS_IN_FLIGHT"  # async scheduling: steps sent before the oldest one's tokens are back
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
        if stats.spec_decode_num_drafts:
            logger.info("%s", spec_decode_line(stats, last))


def spec_decode_line(stats: EngineStats, last: EngineStats | None) -> str:
    """vLLM's SpecDecoding metrics line, over the interval since `last`."""
    def delta(name: str) -> int:
        return getattr(stats, name) - (getattr(last, name) if last else 0)

    drafts, draft_tokens = delta("spec_decode_num_drafts"), delta("spec_decode_num_draft_tokens")
    accepted = delta("spec_decode_num_accepted_tokens")
    previous = last.spec_decode_num_accepted_tokens_per_pos if last else []
    per_pos = [n - (previous[i] if i < len(previous) else 0)
               for i, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos)]
    return ("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d tokens, "
            "Draft acceptance rate: %.1f%%, Per-position acceptance rate: %s" % (
                1 + accepted / drafts if drafts else 0.0, accepted, draft_tokens,
                100 * accepted / draft_tokens if draft_tokens else 0.0,
                ", ".join(f"{n / drafts:.3f}" if drafts else "0.000" for n in per_pos)))


class StepTimer:
    """Where the busy loop's time goes: scheduling, waiting for the workers, turning tokens into
    outputs; and the time from one step's end to the next's, apart for steps that run prompt
    tokens (more than one token for some request) and for steps that only decode."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.schedule_s = self.execute_s = self.update_s = 0.0
        self.last_end: float | None = None
        # Intervals between consecutive steps' ends, by whether the later step ran prompt tokens.
        self.intervals: dict[bool, deque[float]] = {False: deque(maxlen=1 << 16), True: deque(maxlen=1 << 16)}

    def add(self, schedule_s: float, execute_s: float, update_s: float, runs_prompts: bool = False) -> None:
        now = time.perf_counter()
        if self.last_end is not None:
            self.intervals[runs_prompts].append(now - self.last_end)
        self.last_end = now
        self.num_steps += 1
        self.schedule_s += schedule_s
        self.execute_s += execute_s
        self.update_s += update_s

    def __str__(self) -> str:
        per_step = lambda total: 1000 * total / self.num_steps  # noqa: E731
        line = (f"{self.num_steps} steps, per step: schedule {per_step(self.schedule_s):.2f} ms, "
                f"workers {per_step(self.execute_s):.2f} ms, update {per_step(self.update_s):.2f} ms")
        # Medians, so that idle time between bursts of work does not count.
        for runs_prompts, name in ((False, "decode-only"), (True, "with prompt tokens")):
            if intervals := self.intervals[runs_prompts]:
                line += (f"; {name}: {len(intervals)} steps, median {1000 * statistics.median(intervals):.2f} ms "
                         f"from the previous step's end (sum {sum(intervals):.2f} s)")
        return line


def runs_prompts(scheduler_output: SchedulerOutput) -> bool:
    """Whether a step runs more than one token for some request (prompt chunks, or drafts)."""
    return scheduler_output.total_num_scheduled_tokens > len(scheduler_output.num_scheduled_tokens)


class EngineCore:
    """Scheduler + executor, one step at a time. No sockets: EngineCoreProc adds those."""

    def __init__(self, config: EngineConfig, prestarted: "PrestartedWorker | None" = None) -> None:
        self.config = config
        # Async scheduling keeps steps in flight (sent to the workers, tokens not back yet). How
        # many (checked before the workers start): two ahead of the oldest. With one ahead, step
        # N+2 is scheduled only once N's tokens are back, and the round trip (the worker hands N's
        # tokens on, this loop updates and schedules, the worker prepares N+2) had to fit in N+1's
        # GPU time: at batch 1 on an H100 it did not (0.3 ms of the worker waiting per 1.2 ms
        # step). With pipeline parallelism one per stage instead (a batch queue: stage 0 runs batch
        # B+1 while stage 1 runs B; the scheduler keeps a request out of a batch while its previous
        # token is still in flight, so a batch more than the stages would only split the requests
        # thinner).
        setting = os.environ.get(STEPS_IN_FLIGHT_ENV, "3")
        if not setting.strip().isdigit() or int(setting) < 2:
            raise ValueError(f"{STEPS_IN_FLIGHT_ENV}={setting!r}: must be an integer >= 2 (for no async scheduling: "
                             "async_scheduling=False)")
        steps_in_flight = int(setting)
        pp_size = config.pipeline_parallel_size
        self.max_concurrent_batches = pp_size if pp_size > 1 else steps_in_flight
        self.steps_in_flight: deque[SchedulerOutput] = deque()  # oldest first
        # mp or ray, as config.distributed_executor_backend says (prestarted: main's --config-stdin)
        self.executor = make_executor(config, prestarted)
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
        self.peak_batches_in_flight = 0  # the most seen at once (tests and logs read it)
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
        if self.config.async_scheduling or self.config.pipeline_parallel_size > 1:
            return self.step_async()
        if not self.scheduler.has_unfinished_requests():
            return []
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        t1 = time.perf_counter()
        # (A step carrying KV connector metadata goes to the workers even with no tokens.)
        if scheduler_output.total_num_scheduled_tokens > 0 or scheduler_output.kv_connector_metadata is not None:
            model_output = self.executor.execute_model(scheduler_output)
        else:
            model_output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.step_timer.add(t1 - t0, t2 - t1, time.perf_counter() - t2, runs_prompts(scheduler_output))
        return outputs

    def step_async(self) -> list[EngineCoreOutput]:
        """Keep the workers ahead: schedule and submit steps N+1 and N+2, then wait for step N's
        tokens and turn them into outputs while the workers already run N+1. The scheduler counts
        N's tokens as placeholders meanwhile; the workers have them by the time they run N+1.
        With pipeline parallelism up to max_concurrent_batches steps are in flight, each with
        requests the others do not have (Scheduler.pipeline_parallel)."""
        t0 = time.perf_counter()
        submitted = False
        if self.scheduler.has_unfinished_requests() and len(self.steps_in_flight) < self.max_concurrent_batches:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens > 0 or scheduler_output.kv_connector_metadata is not None:
                self.executor.submit(scheduler_output)
                self.steps_in_flight.append(scheduler_output)
                self.peak_batches_in_flight = max(self.peak_batches_in_flight, len(self.steps_in_flight))
                submitted = True
            else:  # nothing runnable until a step in flight reports (or ever, if none is)
                empty = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
                outputs = self.scheduler.update_from_output(scheduler_output, empty)
                if not self.steps_in_flight:
                    return outputs
        t1 = time.perf_counter()
        if not self.steps_in_flight or (submitted and len(self.steps_in_flight) < self.max_concurrent_batches):
            return []  # the pipeline is filling: schedule the next step first
        scheduler_output = self.steps_in_flight.popleft()
        model_output = self.executor.receive_output()
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.step_timer.add(t1 - t0, t2 - t1, time.perf_counter() - t2, runs_prompts(scheduler_output))
        return outputs

    def get_engine_info(self) -> EngineInfo:
        c = self.config
        return EngineInfo(
            model=c.model, tokenizer=c.tokenizer, max_model_len=c.max_model_len, vocab_size=c.vocab_size,
            eos_token_ids=c.eos_token_ids, block_size=c.block_size, num_gpu_blocks=self.num_gpu_blocks,
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            engine_pid=os.getpid(), worker_pids=self.executor.worker_pids,
            scheduling_policy=c.scheduling_policy, enable_prefix_caching=c.enable_prefix_caching,
            max_pending_requests=c.max_pending_requests,
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
            logger.info("%s; at most %d batches in flight", self.step_timer, self.peak_batches_in_flight)
        self.executor.shutdown()


class _ClientGone:
    """Put on the input queue by the socket thread: this frontend's connection is gone."""


_CLIENT_GONE = _ClientGone()


@dataclass
class _BatchPart:
    """Admitted requests of one batch (AddRequests), in order: a large batch reaches the busy loop
    in parts of about a step's prompt tokens, so its first step starts while the socket thread
    still reads the rest. `last`: the part that ends the batch."""

    requests: list[EngineCoreRequest]
    last: bool


class RateLimitedLog:
    """At most `burst` lines per `interval_s` of one kind of complaint; the rest are counted and
    reported with the next line, so a flood of garbage cannot flood the log."""

    def __init__(self, level: int, burst: int = 5, interval_s: float = 10.0) -> None:
        self.level, self.burst, self.interval_s = level, burst, interval_s
        self.window_start = time.monotonic()
        self.logged = self.suppressed = 0

    def __call__(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.window_start >= self.interval_s:
            self.window_start, self.logged = now, 0
        if self.logged >= self.burst:
            self.suppressed += 1
            return
        self.logged += 1
        if self.suppressed:
            msg += f" ({self.suppressed} similar messages suppressed)"
            self.suppressed = 0
        logger.log(self.level, msg, *args)


class EngineCoreProc(EngineCore):
    """An EngineCore serving frontends at a ZMQ address until told to stop.

    Its socket is untrusted input (see README, "The engine boundary"): the socket thread drops
    what does not decode (any frame count, any bytes), answers a request that fails validation
    (protocol/validation.py, the frontend's very function) or comes past max_pending_requests with
    an error of its own, and passes on only what is safe to schedule. With an engine key only
    peers holding it get through the CURVE handshake. A frontend whose connection drops (killed,
    vanished host: ZMTP heartbeats) has its requests aborted and their blocks freed.
    """

    def __init__(self, config: EngineConfig, address: str, engine_key: str | None = None,
                 insecure: bool = False, prestarted: "PrestartedWorker | None" = None) -> None:
        check_bind_allowed(address, engine_key, insecure)  # before the model loads
        self.curve_keys = CurveKeys(engine_key) if engine_key is not None else None
        super().__init__(config, prestarted)
        # Block bookkeeping waits until a step is submitted and its outputs are sent (run_busy_loop).
        self.scheduler.defer_block_updates = True
        self.address = address
        self.limits = EngineLimits.from_engine_info(self.get_engine_info())
        # Bounded: when the busy loop falls behind, the socket thread waits, ZMQ's queues fill
        # (RCVHWM) and senders are pushed back, instead of memory growing.
        self.input_queue: queue.Queue[tuple[bytes, Any]] = queue.Queue(maxsize=_INPUT_QUEUE_SIZE)
        self.request_owner: dict[str, bytes] = {}  # request id -> identity of the frontend that sent it
        self.client_requests: dict[bytes, set[str]] = {}  # identity -> its live request ids
        self.clients: set[bytes] = set()
        # Requests accepted by the socket thread and not finished yet (queued, waiting or running):
        # the socket thread refuses new ones at max_pending_requests.
        self.pending_lock = threading.Lock()
        self.num_pending = 0
        self.stopping = threading.Event()
        # Messages pushed to the outbox and forwarded from it (each counter has one writer), and
        # the socket thread's signal that it forwarded some (_let_socket_thread_send).
        self.num_emitted = 0
        self.num_forwarded = 0
        self.forwarded = threading.Event()
        self.utilities: dict[str, Callable[..., Any]] = {
            "get_engine_info": self.get_engine_info,
            "check_health": lambda: True,
            "get_num_unfinished_requests": self.scheduler.get_num_unfinished_requests,
            "get_stats": self.get_stats,
            "log_stats": self.log_stats,
            "reset_prefix_cache": self.reset_prefix_cache,
        }
        self.peers: set[bytes] = set()  # identities heard from (the socket thread's)
        # A batch of more prompt tokens than a step takes reaches the busy loop in parts
        # (_BatchPart; 0: whole). Whenever the scheduler would look past a part's last request, it
        # waits for the next part (_await_batch_part), so the steps are those of the whole batch.
        # Not where a step's shape depends on the whole waiting queue: priority scheduling (the
        # rest may come first) and pipeline parallelism (a batch's share of the waiting requests).
        splits = config.scheduling_policy in ("fcfs", "v0") and config.pipeline_parallel_size == 1
        self.batch_part_tokens = config.max_num_batched_tokens if splits else 0
        self.batch_open = False  # (the busy loop's) a batch's first part is in, its last is not
        self.deferred_inputs: deque[tuple[bytes, Any]] = deque()  # met while waiting for a part
        if splits:
            self.scheduler.await_more_requests = self._await_batch_part
        self.log_dropped = RateLimitedLog(logging.WARNING)
        self.log_rejected = RateLimitedLog(logging.WARNING)
        self.ctx = zmq.Context()
        self.authenticator = None
        bound = threading.Event()
        self.bind_error: BaseException | None = None
        self.input_thread = threading.Thread(target=self._serve_socket, args=(bound,), name="input", daemon=True)
        self.input_thread.start()
        bound.wait()
        if self.bind_error is not None:
            self.stopping.set()
            self.ctx.destroy(linger=0)
            self.shutdown()
            raise self.bind_error
        # The busy loop's way out: it encodes its outputs and pushes them to the socket thread,
        # which owns the ROUTER socket. (A thread in between, to encode, cost a wake-up per
        # message and ran under the same GIL.)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.connect(_OUTBOX)
        logger.info("EngineCore serving at %s (%s)", address,
                    "CURVE: only frontends with the engine key" if self.curve_keys else "no engine key")

    # -- the busy loop ---------------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        try:
            while not self.stopping.is_set():
                self._process_input(block=not self.has_work())
                outputs = self.step()
                if outputs:
                    self._send_outputs(outputs)
                    if self.scheduler.num_deferred_block_updates() >= _HANDOFF_MIN_BLOCKS:
                        self._let_socket_thread_send()
                self.scheduler.apply_deferred_block_updates()  # (put off until the step and outputs went out)
                if self.stats_logger.due():
                    self.stats_logger.log(self.get_stats())
        except WorkerDiedError as e:
            logger.error("engine dead: %s", e)
            for client in self.clients:
                self._emit(client, EngineCoreOutputs(engine_dead=str(e)))
            raise
        finally:
            self.outbox.close(linger=1000)  # what it holds still reaches the socket thread
            self.stopping.set()
            self.input_thread.join(timeout=5)
            if self.authenticator is not None:
                self.authenticator.stop()
            self.ctx.destroy(linger=0)
            remove_ipc_file(self.address)
            self.shutdown()

    def _process_input(self, block: bool) -> None:
        """Handle everything that arrived; when idle, wait (checking the workers now and then). With
        no step in flight, this returns once a batch's first part is in: the step starts on it
        while the socket thread reads the rest (the scheduler waits for what it needs of that)."""
        while self.deferred_inputs:
            self._handle(*self.deferred_inputs.popleft())
            block = False
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
            if self.batch_open and not self.steps_in_flight:
                return
            block = False

    def _handle(self, identity: bytes, message: Any) -> None:
        """One message the socket thread decoded (and, for a request, validated and admitted)."""
        if message is _CLIENT_GONE:
            self._forget_client(identity)
            return
        self.clients.add(identity)
        if isinstance(message, EngineCoreRequest):
            self._handle_request(identity, message)
        elif isinstance(message, _BatchPart):
            for request in message.requests:
                self._handle_request(identity, request)
            self.batch_open = not message.last
        elif isinstance(message, AbortRequests):
            # Finished and unknown ids are ignored. Not only the sending connection's own: a
            # frontend aborts through a second connection while another thread holds its first.
            outputs = self.abort_requests(message.request_ids)
            if outputs:
                self._send_outputs(outputs)
        elif isinstance(message, UtilityCall):
            self._emit(identity, EngineCoreOutputs(utility_result=self._call_utility(message)))
        elif isinstance(message, Shutdown):
            logger.info("shutdown requested")
            self.stopping.set()

    def _await_batch_part(self) -> bool:
        """The scheduler's waiting queue ran out with room left in the step (Scheduler.
        await_more_requests). If a batch is still coming in parts, wait for its next one, which the
        socket thread is reading now, and add its requests. Other messages met on the way are
        handled after this step is scheduled, in their order. Returns whether a part came."""
        while self.batch_open:
            try:
                identity, message = self.input_queue.get(timeout=_IDLE_WAIT_S)
            except queue.Empty:
                if self.stopping.is_set() or not self.input_thread.is_alive():
                    self.batch_open = False  # no part will come
                continue
            if isinstance(message, _BatchPart):
                self._handle(identity, message)
                return True
            self.deferred_inputs.append((identity, message))
        return False

    def _handle_request(self, identity: bytes, request: EngineCoreRequest) -> None:
        """An admitted request: into the scheduler, unless its id is live already."""
        request_id = request.request_id
        if request_id in self.request_owner:  # live: the id must not be taken from its owner
            self._release_pending(1)
            self._refuse(identity, request_id, ERROR_INVALID,
                         f"request id {request_id!r} is already in use by a live request; give each its own id.")
            return
        self.request_owner[request_id] = identity
        self.client_requests.setdefault(identity, set()).add(request_id)
        try:
            self.add_request(request)
        except Exception as e:  # validated already; whatever still fails, fails alone
            if isinstance(e, ValueError):
                self.log_rejected("rejected request %s: %s", request_id, e)
            else:
                logger.exception("rejected request %s", request_id)
            self._send_outputs([refusal(request_id, ERROR_INVALID, str(e))])

    def _forget_client(self, identity: bytes) -> None:
        """A frontend vanished without detaching: abort its requests (freeing their blocks)."""
        self.clients.discard(identity)
        request_ids = self.client_requests.get(identity, set())
        if request_ids:
            outputs = self.abort_requests(list(request_ids))
            self._send_outputs(outputs, deliver=False)
            logger.warning("a frontend disconnected without detaching: aborted its %d request(s)", len(outputs))
        self.client_requests.pop(identity, None)

    def _refuse(self, identity: bytes, request_id: str, error_type: str, error: str) -> None:
        self._emit(identity, EngineCoreOutputs(outputs=[refusal(request_id, error_type, error)]))

    def _release_pending(self, count: int) -> None:
        with self.pending_lock:
            self.num_pending -= count

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        fn = self.utilities.get(call.method)
        if fn is None:
            return UtilityResult(call.call_id, error=f"unknown utility {call.method!r:.100}; "
                                 f"allowed: {', '.join(self.utilities)}")
        try:
            return UtilityResult(call.call_id, result=fn(*call.args))
        except Exception as e:  # a bad utility call must not take the engine down
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")

    def _send_outputs(self, outputs: list[EngineCoreOutput], deliver: bool = True) -> None:
        by_client: dict[bytes, list[EngineCoreOutput]] = {}
        finished = 0
        for out in outputs:
            owner = self.request_owner.get(out.request_id)
            if out.finish_reason is not None and owner is not None:
                del self.request_owner[out.request_id]
                owned = self.client_requests.get(owner)
                if owned is not None:
                    owned.discard(out.request_id)
                    if not owned:
                        del self.client_requests[owner]
                finished += 1
            if owner is not None and deliver:
                by_client.setdefault(owner, []).append(out)
        if finished:
            self._release_pending(finished)
        for owner, outs in by_client.items():
            self._emit(owner, EngineCoreOutputs(outputs=outs))

    def _emit(self, identity: bytes, outputs: EngineCoreOutputs) -> None:
        """Hand a message for one frontend to the socket thread (busy loop only: the outbox is its)."""
        self.outbox.send_multipart([identity, encode(outputs)])
        self.num_emitted += 1

    def _let_socket_thread_send(self) -> None:
        """Wait (a little at most) until the socket thread has forwarded what the busy loop emitted.

        The outbox wakes the socket thread, but it needs the GIL to send, and the busy loop's next
        Python loop holds it: giving back a finished 32k-token request's 2,000 blocks kept the first
        token ~0.8 ms from the client (H100 host). Waiting on an event lets the socket thread run
        first; the loop calls this only before that much block bookkeeping."""
        target = self.num_emitted
        deadline = time.monotonic() + _HANDOFF_WAIT_S
        while self.num_forwarded < target:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self.forwarded.wait(remaining)
            self.forwarded.clear()  # (the count is raised before each set: re-checked above)

    # -- the I/O threads -------------------------------------------------------------------------

    def _make_router(self) -> tuple[zmq.Socket, zmq.Socket]:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 1000)
        # Sending to a peer that is gone raises EHOSTUNREACH instead of vanishing silently: how the
        # socket thread learns which frontend disconnected (ZMQ has no identity in its events).
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.RCVHWM, _RCVHWM)
        # Outputs are never dropped: a live frontend that falls behind catches up, and one that
        # stops answering is cut off by the heartbeats below (its requests aborted), which is what
        # bounds this queue. (A send high-water mark would drop a slow frontend's tokens -- or
        # the finish its generate() waits for.)
        router.setsockopt(zmq.SNDHWM, 0)
        router.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        # ZMTP heartbeats: a frontend that stops answering (a stopped process, a vanished host) is
        # disconnected within seconds, like one whose process died.
        router.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        router.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        if self.curve_keys is not None:
            self.authenticator = start_client_key_authenticator(self.ctx, self.curve_keys.client_public,
                                                                f"{__name__}.auth")
            self.curve_keys.make_server(router)
        monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED_EVENTS)
        router.bind(self.address)
        if self.address.startswith("ipc://"):  # only this user may connect
            os.chmod(self.address[len("ipc://"):], 0o600)
        return router, monitor

    def _serve_socket(self, bound: threading.Event) -> None:
        """Own the ROUTER socket: decode, check and admit what frontends send; forward what the
        busy loop encoded; notice frontends that are gone."""
        try:
            router, monitor = self._make_router()
            outbox = self.ctx.socket(zmq.PULL)
            outbox.bind(_OUTBOX)
        except BaseException as e:  # e.g. the address is in use: the constructor raises it
            self.bind_error = e
            bound.set()
            return
        bound.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(outbox, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        probe_times: list[float] = []  # when to check which peers are still connected
        while not self.stopping.is_set() or outbox.poll(0):
            events = dict(poller.poll(100))
            if monitor in events:
                while monitor.poll(0):
                    event = recv_monitor_message(monitor)["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        # Which peer? Ask them all, once the socket has dropped the pipe.
                        now = time.monotonic()
                        probe_times += [now + delay for delay in _PROBE_DELAYS_S]
                    else:
                        self.log_dropped("a peer failed the handshake (wrong or missing engine key?): %s",
                                         HANDSHAKE_FAILURES.get(event, f"event {event}"))
            if router in events:
                for _ in range(_MAX_BATCH):
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._receive_frames(router, frames)
            if outbox in events:
                for _ in range(_MAX_BATCH):
                    try:
                        identity, payload = outbox.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._send_to(router, identity, payload)
                    self.num_forwarded += 1
                self.forwarded.set()
            if probe_times and min(probe_times) <= time.monotonic():
                now = time.monotonic()
                probe_times = [t for t in probe_times if t > now]
                for identity in list(self.peers):
                    self._send_to(router, identity, _EMPTY_OUTPUTS)
        router.disable_monitor()
        monitor.close(linger=0)
        router.close()
        outbox.close()

    def _send_to(self, router: zmq.Socket, identity: bytes, payload: bytes) -> None:
        try:
            router.send_multipart([identity, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:  # that frontend is gone
                if identity in self.peers:
                    self.peers.discard(identity)
                    self._enqueue(identity, _CLIENT_GONE)
            else:
                raise

    def _enqueue(self, identity: bytes, message: Any) -> None:
        while not self.stopping.is_set():
            try:
                self.input_queue.put((identity, message), timeout=0.1)
                return
            except queue.Full:  # the busy loop drains it every step
                continue

    def _receive_frames(self, router: zmq.Socket, frames: list[bytes]) -> None:
        """One message off the socket: decode, check and admit it, or drop / answer it. Never raises
        for what a peer sent."""
        if len(frames) != 2:
            self.log_dropped("dropped a message of %d frame(s) (frontends send 1)", len(frames) - 1)
            return
        identity, payload = frames
        try:
            message = engine_socket_decoder.decode(payload)
        except Exception as e:  # msgspec.DecodeError / ValidationError, or worse for hostile bytes
            self._refuse_undecodable(router, identity, _decode_untyped(payload), e)
            return
        if isinstance(message, RawAddRequests):
            self._admit_batch(router, identity, message.requests)
            return
        if isinstance(message, EngineCoreRequest) and not self._admit(router, identity, message):
            return
        self.peers.add(identity)
        self._enqueue(identity, message)

    def _admit_batch(self, router: zmq.Socket, identity: bytes, items: list[msgspec.Raw]) -> None:
        """A batch's requests, each decoded, checked and admitted (or answered) on its own, handed
        to the busy loop in parts of at least batch_part_tokens prompt tokens, the last part
        marked so (_BatchPart)."""
        part: list[EngineCoreRequest] = []
        part_tokens = 0
        opened = False  # a part went before: the batch must be closed by a last one
        yield_at = time.perf_counter() + _YIELD_INTERVAL_S
        for index, item in enumerate(items):
            # Let the busy loop take the GIL when it wants it (a part to schedule, a step to send):
            # else it waits out the interpreter's switch interval (5 ms) behind this loop. A
            # sleep(0) lasts ~60-85 us on Linux (the timer slack), longer than decoding and checking
            # a request, so this loop yields every _YIELD_INTERVAL_S and after each part it hands over.
            if time.perf_counter() >= yield_at:
                time.sleep(0)
                yield_at = time.perf_counter() + _YIELD_INTERVAL_S
            request = self._decode_batch_item(router, identity, item)
            if request is None or not self._admit(router, identity, request):
                continue
            part.append(request)
            part_tokens += len(request.prompt_token_ids)
            if 0 < self.batch_part_tokens <= part_tokens and index + 1 < len(items):
                self.peers.add(identity)
                self._enqueue(identity, _BatchPart(part, last=False))
                opened = True
                part, part_tokens = [], 0
                yield_at = 0.0  # (the busy loop may be waiting for just this part: yield before the next request)
        if part or opened:
            self.peers.add(identity)
            self._enqueue(identity, _BatchPart(part, last=True))

    def _admit(self, router: zmq.Socket, identity: bytes, request: EngineCoreRequest) -> bool:
        """Check a request and count it as pending; else answer its sender why not."""
        try:
            validate_request(request, self.limits, wire=True)
        except ValueError as e:
            self.log_rejected("rejected request %.100s: %s", request.request_id, e)
            self._answer_refused(router, identity, request.request_id, ERROR_INVALID, str(e))
            return False
        with self.pending_lock:
            admitted = self.num_pending < self.config.max_pending_requests
            if admitted:
                self.num_pending += 1
        if not admitted:
            self.log_rejected("refused request %.100s: overloaded (%d pending)", request.request_id,
                              self.config.max_pending_requests)
            self._answer_refused(
                router, identity, request.request_id, ERROR_OVERLOADED,
                f"the engine is overloaded: it holds max_pending_requests={self.config.max_pending_requests} "
                "requests (running + waiting); retry later.")
        return admitted

    def _decode_batch_item(self, router: zmq.Socket, identity: bytes, item: msgspec.Raw) -> EngineCoreRequest | None:
        """One request of a batch, or None after answering its sender why not (if it can be told)."""
        try:
            return request_decoder.decode(item)
        except Exception as e:
            raw = _decode_untyped(item)
            if isinstance(raw, dict) and "type" not in raw:  # (a batch's requests may leave out their tag)
                raw = {**raw, "type": "add"}
            self._refuse_undecodable(router, identity, raw, e)
            return None

    def _refuse_undecodable(self, router: zmq.Socket, identity: bytes, raw: Any, error: Exception) -> None:
        """A message that failed typed decoding (`raw`: as plain msgpack, or None): if it reads as
        a request with an id, its sender is told why; anything else is dropped."""
        request_id = _salvage_request_id(raw)
        if request_id is None:
            self.log_dropped("dropped a message that does not decode: %.200s", error)
        else:  # a request with wrong types or values: tell its sender
            self.log_rejected("rejected request %.100s: %.200s", request_id, error)
            self._answer_refused(router, identity, request_id, ERROR_INVALID, f"invalid request: {error}")

    def _answer_refused(self, router: zmq.Socket, identity: bytes, request_id: str, error_type: str,
                        error: str) -> None:
        self._send_to(router, identity, encode(EngineCoreOutputs(outputs=[refusal(request_id, error_type, error)])))


_INPUT_QUEUE_SIZE = 1024  # messages decoded and not yet handled by the busy loop
_YIELD_INTERVAL_S = 0.0005  # about the longest a batch's admission holds the GIL from the busy loop
_RCVHWM = 512  # messages ZMQ queues per frontend before pushing back on it
_MAX_BATCH = 256  # messages handled per socket per poll, so no socket starves the others
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 5000
# After a disconnect: when to check which peer it was (the socket drops the pipe a moment later).
_PROBE_DELAYS_S = (0.02, 0.1, 0.25, 0.5, 1.0, 2.0)
# An empty EngineCoreOutputs: what a liveness probe sends (frontends read it as nothing new).
_EMPTY_OUTPUTS = encode(EngineCoreOutputs())


def refusal(request_id: str, error_type: str, error: str) -> EngineCoreOutput:
    """The one output of a request the engine refused (ERROR_*): finished as "abort", with why."""
    return EngineCoreOutput(request_id, [], finish_reason=FINISH_ABORT, error_type=error_type, error=error)


def _decode_untyped(payload: bytes) -> Any:
    """The payload as plain msgpack values, or None if it is not msgpack."""
    try:
        return msgspec.msgpack.decode(payload)
    except Exception:
        return None


def _salvage_request_id(raw: Any) -> str | None:
    """The request id of an "add" message (plain msgpack values) that failed typed decoding, if one
    can be read, so its sender gets an answer instead of waiting forever."""
    if isinstance(raw, dict) and raw.get("type") == "add":
        request_id = raw.get("request_id")
        if isinstance(request_id, str) and 0 < len(request_id) <= MAX_REQUEST_ID_LENGTH + WIRE_REQUEST_ID_OVERHEAD:
            return request_id
    return None


def run_engine_core(config: EngineConfig, address: str, engine_key: str | None = None, insecure: bool = False,
                    prestarted: PrestartedWorker | None = None) -> None:
    """Start an EngineCore at `address` and serve until Shutdown, SIGTERM or SIGINT."""
    engine = EngineCoreProc(config, address, engine_key=engine_key, insecure=insecure, prestarted=prestarted)
    freeze_gc_heap("EngineCore")  # (with the worker in this process, its model and graphs too)

    def stop(signum: int, _frame: Any) -> None:
        logger.info("received signal %d, shutting down", signum)
        engine.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    engine.run_busy_loop()


def main() -> None:
    parser = argparse.ArgumentParser(description="minivllm EngineCore process (started by a frontend)")
    config_source = parser.add_mutually_exclusive_group(required=True)
    config_source.add_argument("--config", help="EngineConfig as JSON")
    config_source.add_argument(
        "--config-stdin", action="store_true",
        help="read the EngineConfig (JSON) from stdin, and start worker rank 0 while it comes (the frontend "
             "starts this process before it resolves the config; an empty stdin: exit)")
    parser.add_argument("--address", required=True, help="ZMQ address to serve frontends at")
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("MINIVLLM_LOG_LEVEL", "INFO"),
                        format="%(levelname)s %(asctime)s [engine] %(name)s: %(message)s")
    prestarted = None
    if args.config is not None:
        config = msgspec.json.decode(args.config, type=EngineConfig)
    else:
        prestarted = PrestartedWorker()
        data = sys.stdin.buffer.read()
        if not data:  # the frontend gave up (its config failed)
            prestarted.stop()
            return
        config = msgspec.json.decode(data, type=EngineConfig)
    try:
        run_engine_core(config, args.address, prestarted=prestarted)
    except WorkerDiedError:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
