"""Runs a worker-side KV connector around each model step (the ModelRunner's one hook).

Without a connector the ModelRunner never gets here: make_kv_connector_driver returns None and
run_step is called directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import torch

from minivllm.protocol.config import EngineConfig
from minivllm.protocol.kv_transfer import KVConnectorOutput, kv_connector_name, load_kv_connector_class
from minivllm.protocol.messages import ModelRunnerOutput, SchedulerOutput
from minivllm.worker.kv_connector.base import KVConnectorWorkerBase

logger = logging.getLogger(__name__)


def _merge(a: KVConnectorOutput | None, b: KVConnectorOutput | None) -> KVConnectorOutput | None:
    if a is None or b is None:
        return a or b
    return KVConnectorOutput(
        finished_sending=a.finished_sending + b.finished_sending,
        finished_recving=a.finished_recving + b.finished_recving,
        failed_recving=a.failed_recving + b.failed_recving,
    )


class KVConnectorDriver:
    def __init__(self, connector: KVConnectorWorkerBase) -> None:
        self.connector = connector
        self.decoder = (msgspec.msgpack.Decoder(connector.metadata_type)
                        if connector.metadata_type is not None else None)
        # A report made while the step's output is held back (overlapped outputs) waits for the
        # next output that goes out.
        self.unsent: KVConnectorOutput | None = None

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.connector.register_kv_caches(kv_caches)

    def run_step(self, run_step: Callable[[SchedulerOutput], list[ModelRunnerOutput]],
                 scheduler_output: SchedulerOutput) -> list[ModelRunnerOutput]:
        """`run_step` (the ModelRunner's) with the connector's hooks around it; the connector's
        report rides on the last output that goes out."""
        connector = self.connector
        meta = scheduler_output.kv_connector_metadata
        decoded = None
        if meta is not None and meta.payload and self.decoder is not None:
            decoded = self.decoder.decode(meta.payload)
        connector.bind_connector_metadata(decoded, meta.expired_req_ids if meta is not None else [])
        try:
            connector.handle_preemptions()
            connector.start_load_kv(scheduler_output)
            outputs = run_step(scheduler_output)
            connector.save_kv(scheduler_output)
        finally:
            connector.clear_connector_metadata()
        report = _merge(self.unsent, connector.get_finished(scheduler_output.finished_req_ids))
        if report is None and scheduler_output.total_num_scheduled_tokens == 0:
            time.sleep(connector.poll_interval_s)  # a polling step: let the transfers progress
            report = connector.get_finished([])
        if report is not None and not outputs:
            self.unsent = report
            return outputs
        self.unsent = None
        if report is not None:
            # A copy: run_step may hand out a shared empty output.
            outputs[-1] = msgspec.structs.replace(outputs[-1], kv_connector_output=report)
        return outputs

    def shutdown(self) -> None:
        self.connector.shutdown()


def make_kv_connector_driver(config: EngineConfig, rank: int, device: torch.device) -> KVConnectorDriver | None:
    """The driver of the worker-side connector `config` selects, or None (no connector)."""
    name = kv_connector_name(config)
    if name is None:
        return None
    cls = load_kv_connector_class(name, "worker")
    logger.info("KV connector %s on rank %d", name, rank)
    return KVConnectorDriver(cls(config, rank, device))
