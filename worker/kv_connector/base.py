"""The worker side of a KV connector (vLLM V1's KVConnectorBase_V1, worker half).

One instance per worker process (per TP rank; each rank holds its own shard of the KV heads,
and every rank receives the same metadata). The driver (driver.py) calls, for every step that
reaches the worker (see core/kv_connector/base.py for the scheduler half and the whole contract):

    bind_connector_metadata(metadata, expired_req_ids)
    handle_preemptions()      before the forward: copy out of blocks the scheduler freed for reuse
                              in this step (swap-out, spills). The forward must not overwrite them
                              before the copy has read them (on CUDA: make the compute stream wait).
                              Drop transfers of expired_req_ids here too.
    start_load_kv(out)        before the forward: start loading into paged blocks. A synchronous
                              load (load_async=False) must be complete, or stream-ordered before
                              the forward; an asynchronous one runs on while the forward computes,
                              and the request's id goes into finished_recving once it is done.
    -- the forward runs (launched) --
    save_kv(out)              after the forward is launched: start saving/sending computed blocks.
    get_finished(finished_req_ids) -> KVConnectorOutput | None
                              transfers completed since the last call (each id reported once);
                              finished_req_ids: the ids the scheduler finished since last step.
    clear_connector_metadata()

Only rank 0's report reaches the scheduler: with tensor parallelism a connector must not report a
load finished before every rank's copy of it is usable (e.g. each rank orders its compute after
its own load before the forward that reads it).

On a step with no tokens scheduled (it only carries metadata) the forward is skipped; if nothing
finished, the driver then sleeps `poll_interval_s` so an idle engine waiting for KV does not spin.
KV cache tensors: one per layer, [2, num_blocks, block_size, num_kv_heads, head_dim] (K = [0]).
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
import torch

from minivllm.protocol.config import EngineConfig
from minivllm.protocol.kv_transfer import KVConnectorOutput
from minivllm.protocol.messages import SchedulerOutput


class KVConnectorWorkerBase:
    # The Struct the scheduler side's build_connector_meta returns (decoded from the payload).
    metadata_type: ClassVar[type[msgspec.Struct] | None] = None
    poll_interval_s: ClassVar[float] = 0.001

    def __init__(self, config: EngineConfig, rank: int, device: torch.device) -> None:
        self.config = config
        self.rank = rank
        self.device = device
        self.kv_transfer_config = config.kv_transfer_config
        self.kv_caches: list[torch.Tensor] = []
        self._metadata: Any = None
        self._expired_req_ids: list[str] = []

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The paged KV cache, once it is allocated (before any step)."""
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: Any, expired_req_ids: list[str]) -> None:
        self._metadata = metadata
        self._expired_req_ids = expired_req_ids

    def clear_connector_metadata(self) -> None:
        self._metadata = None
        self._expired_req_ids = []

    @property
    def connector_metadata(self) -> Any:
        """This step's metadata (an instance of metadata_type), or None."""
        return self._metadata

    def handle_preemptions(self) -> None:
        pass

    def start_load_kv(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def save_kv(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def get_finished(self, finished_req_ids: list[str]) -> KVConnectorOutput | None:
        return None

    def shutdown(self) -> None:
        pass
