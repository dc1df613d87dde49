"""Data parallelism: N engine cores behind one frontend (data_parallel_size, vLLM's name).

Each core is a whole engine (its own scheduler, KV cache, and tensor-parallel group of workers);
they share nothing but the frontend. The frontend sends each new request to the least loaded
core, as the cores report their load, and everything else about a request (its outputs, an abort)
goes to and from the core that holds it.

    LLM / AsyncLLM -- DPEngineCoreClient --+-- EngineCore 0 -- workers
                      (LoadBalancer)       +-- EngineCore 1 -- workers ...

Load: each core answers the `get_stats` utility with its waiting and running requests and KV
usage; the frontend asks every core again whenever its last answer is older than
STATS_REFRESH_S while requests are sent or awaited. A waiting request weighs more than a running
one (it says the core is full), and requests sent since the last answer count as waiting, so a
burst between two answers still spreads; ties go to the core with the emptier KV cache.

Placement: with distributed_executor_backend="mp" (or "uni") the cores are local processes, and
on CUDA each gets its own tensor_parallel_size devices (CUDA_VISIBLE_DEVICES slices). With "ray"
the cores are local processes too, and each places its workers through Ray (its own placement
group); when no cluster is running the frontend starts one, so that all cores share it.

A core that dies makes the whole engine dead (EngineDeadError), as with one core.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from contextlib import ExitStack
from typing import Any, Callable

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from minivllm.frontend.core_client import (
    AsyncEngineCoreClient,
    EngineCoreClient,
    spawn_engine_process,
)
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineInfo,
    EngineStats,
    UtilityCall,
    UtilityResult,
)
from minivllm.protocol.serial import engine_output_decoder

logger = logging.getLogger(__name__)

STATS_REFRESH_S = 0.05  # how stale a core's load report may get while requests come and go
POLL_MS = 500
WAITING_WEIGHT = 4  # a waiting request counts as this many running ones (vLLM's weighting)


class CoreLoad:
    """What the balancer knows about one core."""

    def __init__(self) -> None:
        self.waiting = self.running = 0
        self.kv_cache_usage = 0.0
        self.unreported = 0  # requests sent to it that no report has counted yet
        self.counted_by_request = 0  # of those, how many the report asked for will count
        self.requested_at = float("-inf")
        self.request_pending = False

    def score(self) -> tuple[int, float]:
        return WAITING_WEIGHT * (self.waiting + self.unreported) + self.running, self.kv_cache_usage


class LoadBalancer:
    """Least loaded core wins. Thread-safe: reports may arrive on another thread than the adds."""

    def __init__(self, num_cores: int) -> None:
        self.loads = [CoreLoad() for _ in range(num_cores)]
        self.lock = threading.Lock()

    def pick(self) -> int:
        with self.lock:
            return min(range(len(self.loads)), key=lambda i: (*self.loads[i].score(), i))

    def added(self, core: int) -> None:
        with self.lock:
            self.loads[core].unreported += 1

    def report_due(self, core: int, now: float) -> bool:
        load = self.loads[core]
        return not load.request_pending and now - load.requested_at >= STATS_REFRESH_S

    def report_requested(self, core: int, now: float) -> None:
        """A get_stats request went out: the core has received every request sent before it."""
        with self.lock:
            load = self.loads[core]
            load.request_pending, load.requested_at = True, now
            load.counted_by_request = load.unreported

    def report_received(self, core: int, stats: EngineStats | None) -> None:
        with self.lock:
            load = self.loads[core]
            load.request_pending = False
            if stats is not None:
                load.waiting, load.running = stats.num_waiting_reqs, stats.num_running_reqs
                load.kv_cache_usage = stats.kv_cache_usage
                load.unreported -= load.counted_by_request
            load.counted_by_request = 0


class _Core(EngineCoreClient):
    """The blocking connection to one core: its load reports go to the balancer, not to a caller."""

    def __init__(self, address: str, proc: Any, index: int, balancer: LoadBalancer) -> None:
        super().__init__(address, proc)
        self.index = index
        self.balancer = balancer
        self.stats_call_id: int | None = None
        self.label = f"data-parallel engine core {index}: "

    def request_load_report(self) -> None:
        """Ask for a load report without waiting for it (hold io_lock)."""
        self.stats_call_id = next(self.call_ids)
        self.balancer.report_requested(self.index, time.monotonic())
        self._send(UtilityCall(self.stats_call_id, "get_stats"))

    def _on_utility_result(self, result: UtilityResult) -> None:
        if result.call_id != self.stats_call_id:
            return super()._on_utility_result(result)
        self.stats_call_id = None
        stats = msgspec.convert(result.result, EngineStats) if result.error is None else None
        self.balancer.report_received(self.index, stats)


def core_environments(config: EngineConfig) -> list[dict[str, str]]:
    """Each core's environment: under mp or uni on CUDA, its own slice of the visible devices."""
    n, tp = config.data_parallel_size, config.tensor_parallel_size
    envs = [dict(os.environ) for _ in range(n)]
    if config.distributed_executor_backend in ("mp", "uni"):
        from minivllm.protocol.config import runs_on_cuda

        if runs_on_cuda(config.device):
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible is not None:
                devices = [d.strip() for d in visible.split(",") if d.strip()]
            else:
                import torch

                devices = [str(i) for i in range(torch.cuda.device_count())]
            for i, env in enumerate(envs):
                env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[i * tp:(i + 1) * tp])
    return envs


def combine_stats(stats: list[EngineStats]) -> EngineStats:
    """All cores' stats as one engine's: counts add up; KV usage is over all blocks."""
    blocks = sum(s.num_gpu_blocks for s in stats)
    def add(values: list) -> int | list[int]:  # per-position lists add up position by position
        if isinstance(values[0], list):
            return [sum(column) for column in itertools.zip_longest(*values, fillvalue=0)]
        return sum(values)

    summed = {f: add([getattr(s, f) for s in stats]) for f in EngineStats.__struct_fields__
              if f not in ("kv_cache_usage", "num_gpu_blocks")}
    usage = sum(s.kv_cache_usage * s.num_gpu_blocks for s in stats) / blocks if blocks else 0.0
    return EngineStats(kv_cache_usage=usage, num_gpu_blocks=blocks, **summed)


def combine_engine_info(infos: list[EngineInfo]) -> EngineInfo:
    """What the frontend sees: one core's limits for a request (num_gpu_blocks: the smallest
    core's, since one request runs on one core), the sum of the capacities for how many requests
    it may hold, and every core's worker."""
    first = infos[0]
    return msgspec.structs.replace(
        first,
        num_gpu_blocks=min(i.num_gpu_blocks for i in infos),
        max_num_seqs=sum(i.max_num_seqs for i in infos),
        max_pending_requests=sum(i.max_pending_requests for i in infos),
        worker_pids=[pid for i in infos for pid in i.worker_pids],
    )


# How utilities answer for the whole group (others: every core runs it, core 0's answer counts).
_COMBINE: dict[str, Callable[[list[Any]], Any]] = {
    "get_stats": lambda results: combine_stats([msgspec.convert(r, EngineStats) for r in results]),
    "get_engine_info": lambda results: combine_engine_info([msgspec.convert(r, EngineInfo) for r in results]),
    "get_num_unfinished_requests": sum,
    "reset_prefix_cache": all,
}


def _combine(method: str, results: list[Any], type: Any) -> Any:
    combine = _COMBINE.get(method)
    result = results[0] if combine is None else combine(results)
    return result if type is Any else msgspec.convert(result, type, from_attributes=True)


class DPEngineCoreClient:
    """The blocking client (for LLM) over data_parallel_size engine cores; EngineCoreClient's
    interface. generate() runs in one thread; aborts and utilities may come from any."""

    def __init__(self, cores: list[_Core], balancer: LoadBalancer, connected_ray: bool = False) -> None:
        self.cores = cores
        self.balancer = balancer
        self.connected_ray = connected_ray
        self.engine_info = combine_engine_info([core.engine_info for core in cores])
        self.poller = zmq.Poller()
        for core in cores:
            self.poller.register(core.socket, zmq.POLLIN)
            self.poller.register(core.monitor, zmq.POLLIN)

    @classmethod
    def spawn(cls, config: EngineConfig) -> "DPEngineCoreClient":
        """Start the cores (in parallel) and wait until all of them serve."""
        connected_ray, ray_address = _share_one_ray_cluster(config)
        balancer = LoadBalancer(config.data_parallel_size)
        cores: list[_Core] = []
        try:
            for index, env in enumerate(core_environments(config)):
                if ray_address is not None:
                    env["RAY_ADDRESS"] = ray_address
                address, proc = spawn_engine_process(config, f"engine-dp{index}", env)
                cores.append(_Core(address, proc, index, balancer))
            for core in cores:
                core.wait_ready()
        except BaseException:
            _stop_all(cores)
            if connected_ray:
                import ray

                ray.shutdown()
            raise
        logger.info("%d data-parallel engine cores serving (pids %s)", len(cores),
                    [core.engine_info.engine_pid for core in cores])
        return cls(cores, balancer, connected_ray)

    @property
    def engine_pids(self) -> list[int]:
        return [core.engine_info.engine_pid for core in self.cores]

    @property
    def dead_reason(self) -> str | None:
        return next((core.dead_reason for core in self.cores if core.dead_reason is not None), None)

    def _check_alive(self) -> None:
        for core in self.cores:  # one dead core: the engine is dead
            core._check_alive()

    # -- requests -------------------------------------------------------------------------------

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Each to the least loaded core at its turn, each core's share sent as one batch."""
        self._check_alive()
        shares: dict[int, list[EngineCoreRequest]] = {}
        for request in requests:
            index = self.balancer.pick()
            shares.setdefault(index, []).append(request)
            self.balancer.added(index)
        for index, share in shares.items():
            core = self.cores[index]
            core.add_requests(share)
            if self.balancer.report_due(index, time.monotonic()) and core.io_lock.acquire(blocking=False):
                try:
                    core.request_load_report()
                finally:
                    core.io_lock.release()

    def abort_requests(self, request_ids: list[str]) -> None:
        """Each core is told only of its own requests among these."""
        for core in self.cores:
            core.abort_requests(request_ids)

    def get_unfinished_request_ids(self) -> list[str]:
        return [i for core in self.cores for i in core.get_unfinished_request_ids()]

    def get_outputs(self, timeout: float | None = None) -> list[EngineCoreOutput]:
        """The outputs that arrived from any core; waits up to `timeout` seconds (None: until some arrive)."""
        with ExitStack() as stack:
            for core in self.cores:
                stack.enter_context(core.io_lock)
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                self._check_alive()
                outputs = [out for core in self.cores for out in core.pending_outputs]
                if outputs:
                    for core in self.cores:
                        core.pending_outputs = []
                    return outputs
                now = time.monotonic()
                for core in self.cores:
                    if core.live_request_ids and self.balancer.report_due(core.index, now):
                        core.request_load_report()
                if deadline is not None and now >= deadline:
                    return []
                wait_ms = POLL_MS if deadline is None else min(POLL_MS, max(0, int((deadline - now) * 1000)))
                events = dict(self.poller.poll(min(wait_ms, int(STATS_REFRESH_S * 1000) + 1)))
                for core in self.cores:
                    # Messages before connection events (a dying engine's last message says why).
                    while core.socket.poll(0):
                        core._on_message(engine_output_decoder.decode(core.socket.recv()))
                    if core.monitor in events:
                        core._on_monitor_event(recv_monitor_message(core.monitor)["event"])

    def call_utility(self, method: str, *args: Any, type: Any = Any, timeout: float | None = None) -> Any:
        """Run the utility on every core; get_stats, get_engine_info, get_num_unfinished_requests
        and reset_prefix_cache answer for the whole group, others with core 0's answer."""
        results = [core.call_utility(method, *args, timeout=timeout) for core in self.cores]
        return _combine(method, results, type)

    def shutdown(self) -> None:
        _stop_all(self.cores)
        if self.connected_ray:
            import ray

            self.connected_ray = False
            ray.shutdown()


class DPAsyncEngineCoreClient:
    """The asyncio client (for AsyncLLM) over data_parallel_size engine cores: one
    AsyncEngineCoreClient per core, each routing its requests' outputs to their queues."""

    def __init__(self, control: DPEngineCoreClient) -> None:
        self.control = control
        self.cores = [AsyncEngineCoreClient(core) for core in control.cores]
        self.balancer = control.balancer
        self.engine_info = control.engine_info
        self.report_task: asyncio.Task | None = None

    @classmethod
    def spawn(cls, config: EngineConfig) -> "DPAsyncEngineCoreClient":
        return cls(DPEngineCoreClient.spawn(config))

    @property
    def engine_pids(self) -> list[int]:
        return self.control.engine_pids

    @property
    def dead_reason(self) -> str | None:
        return next((core.dead_reason for core in self.cores if core.dead_reason is not None), None)

    def _check_alive(self) -> None:
        for core in self.cores:
            core._check_alive()

    async def add_request(self, request: EngineCoreRequest, stream: asyncio.Queue | None = None) -> asyncio.Queue:
        self._check_alive()
        index = self.balancer.pick()
        stream = await self.cores[index].add_request(request, stream)
        self.balancer.added(index)
        if self.report_task is None or self.report_task.done():
            self.report_task = asyncio.get_running_loop().create_task(self._refresh_load(), name="minivllm-dp-load")
        return stream

    async def _refresh_load(self) -> None:
        """While requests are live, keep every core's load report fresh."""
        while any(core.live_request_ids for core in self.cores) and self.dead_reason is None:
            now = time.monotonic()
            due = [i for i in range(len(self.cores)) if self.balancer.report_due(i, now)]
            for i in due:
                self.balancer.report_requested(i, now)
            results = await asyncio.gather(*(self.cores[i].call_utility("get_stats", type=EngineStats) for i in due),
                                           return_exceptions=True)
            for i, result in zip(due, results):
                self.balancer.report_received(i, result if isinstance(result, EngineStats) else None)
            await asyncio.sleep(STATS_REFRESH_S)

    def abort_requests(self, request_ids: list[str], drop_streams: bool = False) -> None:
        """Each core is told only of its own requests among these."""
        for core in self.cores:
            core.abort_requests(request_ids, drop_streams=drop_streams)

    def has_request(self, request_id: str) -> bool:
        return any(core.has_request(request_id) for core in self.cores)

    def get_unfinished_request_ids(self) -> list[str]:
        return [i for core in self.cores for i in core.get_unfinished_request_ids()]

    async def call_utility(self, method: str, *args: Any, type: Any = Any) -> Any:
        results = await asyncio.gather(*(core.call_utility(method, *args) for core in self.cores))
        return _combine(method, list(results), type)

    def shutdown(self) -> None:
        if self.report_task is not None and not self.report_task.done() and not self.report_task.get_loop().is_closed():
            self.report_task.cancel()
        for core in self.cores:  # this thread's sockets and streams; then the engines, all at once
            core.shutdown(stop_engine=False)
        self.control.shutdown()


def _stop_all(cores: list[EngineCoreClient]) -> None:
    _in_parallel([core.shutdown for core in cores])


def _in_parallel(calls: list[Callable[[], None]]) -> None:
    """Run the calls at once (each waits for its own process to exit); log, never raise."""
    def run(call: Callable[[], None]) -> None:
        try:
            call()
        except Exception:
            logger.exception("shutting down a data-parallel engine core failed")

    threads = [threading.Thread(target=run, args=(call,), daemon=True) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _share_one_ray_cluster(config: EngineConfig) -> tuple[bool, str | None]:
    """Under ray, join (or, with none running, start) the cluster here, so that every core joins
    the same one rather than each starting its own, all claiming the same GPUs. Returns whether
    this connected, and the cluster's address for the cores."""
    if config.distributed_executor_backend != "ray":
        return False, None
    import ray

    from minivllm.core.ray_executor import connect_ray

    connected = connect_ray()
    return connected, ray.get_runtime_context().gcs_address
