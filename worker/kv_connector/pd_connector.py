"""Prefill/decode disaggregation, worker side: over ZMQ/TCP (the ZmqTcpConnector) or device to
device (the P2pNcclConnector: NCCL between GPUs, gloo on CPU; ZMQ still carries the control).

Each worker rank runs its half of the transport (pd_zmq_transport): a producer rank serves its
shard of the held blocks at kv_port + rank; a consumer rank pulls its shard from the same rank of
the producer in a background thread, while the model runs other requests (transfer overlaps
compute; each layer is scattered into the cache as it arrives). See worker/kv_connector/base.py
for when the driver calls what.
"""

from __future__ import annotations

import json
import logging
import os
from typing import ClassVar

import torch

from minivllm.core.kv_connector.pd_connector import PDConnectorMetadata
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.kv_transfer import KVConnectorOutput
from minivllm.protocol.messages import SchedulerOutput
from minivllm.worker.kv_connector.base import KVConnectorWorkerBase
from minivllm.worker.kv_connector.pd_nccl_transport import NcclBlockPuller, NcclBlockServer
from minivllm.worker.kv_connector.pd_zmq_transport import KVBlockPuller, KVBlockServer, PullJob, record_compute
from minivllm.worker.kv_connector.tp_reports import TPReportCombiner

logger = logging.getLogger(__name__)

DEFAULT_PULL_TIMEOUT_S = 30.0  # a producer silent this long mid-transfer fails the request
DEFAULT_HOLD_TIMEOUT_S = 120.0  # held blocks nobody pulls this long are freed
# When set (by `bench compare`), rank 0 of a consumer appends {"bytes", "seconds"} per pull here.
KV_TRANSFER_STATS_ENV = "MINIVLLM_KV_TRANSFER_STATS"


class PDConnectorWorker(KVConnectorWorkerBase):
    metadata_type: ClassVar[type] = PDConnectorMetadata
    poll_interval_s: ClassVar[float] = 0.002
    # The transport's consumer half (pd_nccl_transport has the GPU-to-GPU one); make_server makes
    # the producer half.
    puller_class: ClassVar[type[KVBlockPuller]] = KVBlockPuller

    def __init__(self, config: EngineConfig, rank: int, device: torch.device) -> None:
        super().__init__(config, rank, device)
        transfer = config.kv_transfer_config
        extra = transfer.kv_connector_extra_config
        self.role = transfer.kv_role
        self.host = transfer.kv_ip
        self.port = transfer.kv_port
        self.pull_timeout_s = float(extra.get("pull_timeout_s", DEFAULT_PULL_TIMEOUT_S))
        self.hold_timeout_s = float(extra.get("hold_timeout_s", DEFAULT_HOLD_TIMEOUT_S))
        self.server: KVBlockServer | None = None
        self.puller: KVBlockPuller | None = None
        self.stats_path = os.environ.get(KV_TRANSFER_STATS_ENV) if rank == 0 else None
        # Tensor parallelism: rank r serves / pulls shard r (from the producer's rank r), and a
        # transfer is reported once every rank's shard is done.
        self.tp_reports: TPReportCombiner | None = None

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if self.config.tensor_parallel_size > 1:
            self.tp_reports = TPReportCombiner(self.config.tensor_parallel_size)
        if self.role in ("kv_producer", "kv_both"):
            self.server = self.make_server(kv_caches)
        if self.role in ("kv_consumer", "kv_both"):
            self.puller = self.puller_class(kv_caches, self.pull_timeout_s)

    def make_server(self, kv_caches: list[torch.Tensor]) -> KVBlockServer:
        return KVBlockServer(kv_caches, self.host, self.port + self.rank, self.hold_timeout_s)

    def handle_preemptions(self) -> None:
        # The scheduler gave up on these (its transfer timeout), or they were aborted or preempted
        # after their hold, and their blocks were freed in this step: stop writing into (or
        # serving) them before the forward reuses them.
        metadata: PDConnectorMetadata | None = self.connector_metadata
        released = [*self._expired_req_ids, *(metadata.reqs_to_release if metadata is not None else [])]
        if released:
            if self.tp_reports is not None:
                self.tp_reports.forget(released)
            if self.puller is not None:
                self.puller.cancel(self._expired_req_ids)
            if self.server is not None:
                self.server.drop(released)

    def start_load_kv(self, scheduler_output: SchedulerOutput) -> None:
        """Start this step's pulls (they run in the background)."""
        metadata: PDConnectorMetadata | None = self.connector_metadata
        if metadata is None:
            return
        ready = record_compute(self.device) if metadata.reqs_to_recv else None
        for spec in metadata.reqs_to_recv:
            address = f"tcp://{spec.remote_host}:{spec.remote_port + self.rank}"
            self.puller.start(PullJob(spec.req_id, spec.remote_req_id, address, spec.remote_block_ids,
                                      spec.local_block_ids, ready))
        if self.tp_reports is not None:
            self.tp_reports.started([s.req_id for s in metadata.reqs_to_recv], [s.req_id for s in metadata.reqs_to_send])

    def save_kv(self, scheduler_output: SchedulerOutput) -> None:
        """Serve the blocks of this step's holds: after the forward is enqueued, as it may be the
        one that computes them (a transfer's copies wait for what is enqueued before them)."""
        metadata: PDConnectorMetadata | None = self.connector_metadata
        if metadata is not None and metadata.reqs_to_send:
            ready = record_compute(self.device)
            for spec in metadata.reqs_to_send:
                self.server.hold(spec.req_id, spec.block_ids, ready)

    def get_finished(self, finished_req_ids: list[str]) -> KVConnectorOutput | None:
        finished_sending = self.server.take_released() if self.server is not None else set()
        finished_recving: set[str] = set()
        failed: dict[str, str] = {}
        if self.puller is not None:
            finished_recving, failed = self.puller.take_finished()
            transfers = self.puller.take_transfers()
            if self.stats_path and transfers:
                with open(self.stats_path, "a") as f:
                    for _, num_bytes, seconds in transfers:
                        f.write(json.dumps({"bytes": num_bytes, "seconds": seconds}) + "\n")
        for req_id, why in failed.items():
            logger.error("request %s: its KV could not be pulled: %s", req_id, why)
        if self.tp_reports is not None:
            finished_sending, finished_recving, failed = self.tp_reports.combine(finished_sending, finished_recving,
                                                                                 failed)
        if not (finished_sending or finished_recving or failed):
            return None
        return KVConnectorOutput(finished_sending=sorted(finished_sending), finished_recving=sorted(finished_recving),
                                 failed_recving=sorted(failed))

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.puller is not None:
            self.puller.close()


class P2pNcclConnectorWorker(PDConnectorWorker):
    """The same protocol with the blocks moving device to device (pd_nccl_transport): NCCL between
    GPUs, gloo between CPU instances. The scheduler side is the ZmqTcpConnector's."""

    puller_class: ClassVar[type[KVBlockPuller]] = NcclBlockPuller

    def make_server(self, kv_caches: list[torch.Tensor]) -> KVBlockServer:
        return NcclBlockServer(kv_caches, self.host, self.port + self.rank, self.hold_timeout_s, self.pull_timeout_s)
