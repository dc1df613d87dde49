"""The scheduler side of a KV connector (vLLM V1's KVConnectorBase_V1, scheduler half).

How a connector is written
==========================
A connector is two classes registered under one name in protocol/kv_transfer.py KV_CONNECTORS
(`register_kv_connector(name, "pkg.mod:SchedulerClass", "pkg.mod:WorkerClass")`) and selected
with EngineConfig.kv_transfer_config = KVTransferConfig(kv_connector=name, kv_role=...):

* a subclass of KVConnectorSchedulerBase (here; pure Python, in the EngineCore process), which
  decides what moves: it answers the Scheduler's questions below and, each step, builds one
  msgspec Struct of instructions for the worker side;
* a subclass of worker/kv_connector/base.py KVConnectorWorkerBase (in every worker process),
  which receives that Struct (its `metadata_type`), moves the KV in and out of the paged KV cache
  tensors and reports which requests' transfers finished (protocol KVConnectorOutput).

The Scheduler's side of the contract (all calls from the EngineCore's busy loop, one thread):

1. add_request -> validate_kv_transfer_params(request): request.kv_transfer_params came over the
   engine socket (untrusted). Raise ValueError to refuse that request alone (the client gets an
   "invalid" error); never let a bad value reach a later call. It is the scheduler's last check:
   a request not refused here is added, so a connector may start tracking it here.
2. When a request without blocks is about to be admitted, after the GPU prefix-cache lookup found
   `num_computed_tokens` tokens: get_num_new_matched_tokens(request, num_computed_tokens) ->
   (n, load_async): n more tokens can come from outside. The scheduler clamps n so that at least
   the last known token is computed here (it needs its logits).
     - load_async=False: the worker side loads them in this very step, before the forward
       (start_load_kv); the tokens count as computed at once.
     - load_async=True: the scheduler allocates blocks for them and parks the request in
       WAITING_FOR_REMOTE_KVS (blocks held, not scheduled, no seat taken) until the worker
       reports its id in finished_recving (then it is scheduled with the tokens counted as
       computed) or failed_recving (then it finishes with error ERROR_KV_TRANSFER). Its blocks
       join the prefix cache only after the KV arrived.
   first_output_token(request) may name the token sampled after the prompt where its KV was
   computed: then the whole prompt may load asynchronously, and when it has, the request appends
   that token (reported to the client as sampled) and decodes from it.
3. update_state_after_alloc(request, block_ids, n): right after that allocation. block_ids are all
   the request's blocks; request.num_computed_tokens is (still) the locally computed count, and
   the n external tokens go into positions [num_computed_tokens, num_computed_tokens + n), i.e.
   from block_ids[num_computed_tokens // block_size] on.
4. request_preempted(request, block_ids, num_computed_tokens): a request loses its blocks: a
   running request is preempted, or a waiting one gives up KV loaded for it (a running request
   needs the blocks). They are freed right after this call and may be rewritten in this very
   step, so anything to keep must be copied in this step's handle_preemptions (before the
   forward). Its tokens [0, num_computed_tokens) have valid KV in block_ids (once the steps
   already sent have run). When it is admitted again, step 2 asks for it as for any request
   (that is how swap-in happens).
5. build_connector_meta(scheduler_output) -> Struct | None: called once per step after
   scheduling, with the SchedulerOutput about to be sent (the scheduled requests'
   num_computed_tokens already count this step's tokens; bind_block_ids gave the lookup of their
   blocks); return this step's instructions (and reset what was handed over). The Struct must be
   of the worker side's metadata_type.
6. update_connector_output(output): each KVConnectorOutput from the worker (the Scheduler also
   acts on its ids itself, as described in 2 and 7).
7. request_finished(request, block_ids) -> (delay_free, kv_transfer_params): exactly once per
   request that finishes (stopped, length, aborted, failed), before its blocks are freed.
   delay_free=True keeps the blocks until the worker reports the id in finished_sending (e.g. a
   prefill instance waiting for the decode instance to pull the KV). kv_transfer_params (a dict,
   or None) goes to the client on the request's last EngineCoreOutput.
8. has_pending_work() -> bool: True keeps steps going to the workers while nothing is scheduled
   (so queued copies run and finished transfers get reported).

Timeouts: a request in WAITING_FOR_REMOTE_KVS, or finished with delayed-free blocks, for more
than `transfer_timeout_s` (kv_connector_extra_config["transfer_timeout_s"], default 120) is given
up on: the waiting one fails with ERROR_KV_TRANSFER, the delayed blocks are freed. Either way its
id is listed in the next KVConnectorMetadata.expired_req_ids, and request_finished is called for
the waiting one (the sender is not told again). The worker side must then drop the transfer
before that step's forward: its blocks now belong to others.

With no connector configured none of this runs: the Scheduler skips every call.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from minivllm.protocol.config import EngineConfig
from minivllm.protocol.kv_transfer import KVConnectorOutput, kv_connector_name, load_kv_connector_class

if TYPE_CHECKING:
    from minivllm.core.block_pool import BlockPool
    from minivllm.core.request import Request
    from minivllm.protocol.messages import SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_TRANSFER_TIMEOUT_S = 120.0


class KVConnectorSchedulerBase:
    """Scheduler side of a KV connector. Every method has a do-nothing default, so a connector
    overrides only what it uses. See the module docstring for the contract."""

    def __init__(self, config: EngineConfig, num_gpu_blocks: int) -> None:
        self.config = config
        self.block_size = config.block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.kv_transfer_config = config.kv_transfer_config  # None when selected by kv_offloading_size
        extra = self.kv_transfer_config.kv_connector_extra_config if self.kv_transfer_config else {}
        self.transfer_timeout_s = float(extra.get("transfer_timeout_s", DEFAULT_TRANSFER_TIMEOUT_S))

    @property
    def kv_role(self) -> str:
        return self.kv_transfer_config.kv_role if self.kv_transfer_config else "kv_both"

    def bind_block_pool(self, block_pool: "BlockPool") -> None:
        """The GPU block pool, once at start (e.g. to watch prefix-cache evictions)."""

    def bind_block_ids(self, get_block_ids: Callable[[str], list[int]]) -> None:
        """How to look up a running request's block ids, once at start."""

    def validate_kv_transfer_params(self, request: "Request") -> None:
        """Raise ValueError (the client sees the message) if request.kv_transfer_params is unusable."""

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens loadable from outside past num_computed_tokens, whether they load asynchronously)."""
        return 0, False

    def first_output_token(self, request: "Request") -> int | None:
        """The first output token, sampled where the prompt's KV was computed, if it comes with an
        asynchronous load of the whole prompt: the request then starts decoding from it, as it
        would have there, with no forward of its own for the last prompt token."""
        return None

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks were allocated for the tokens get_num_new_matched_tokens offered."""

    def request_preempted(self, request: "Request", block_ids: list[int], num_computed_tokens: int) -> None:
        """A request loses its blocks (they may be reused in this very step)."""

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> msgspec.Struct | None:
        """This step's instructions for the worker side (None: nothing)."""
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the worker side reported."""

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(keep the blocks until finished_sending reports the request, kv_transfer_params for the client)."""
        return False, None

    def reset_prefix_cache(self) -> None:
        """The GPU prefix cache was just emptied (reset_prefix_cache): forget cached KV too."""

    def has_pending_work(self) -> bool:
        """Whether the worker side must be stepped although nothing is scheduled."""
        return False


def make_scheduler_connector(config: EngineConfig, num_gpu_blocks: int) -> KVConnectorSchedulerBase | None:
    """The scheduler side of the connector `config` selects, or None."""
    name = kv_connector_name(config)
    if name is None:
        return None
    cls = load_kv_connector_class(name, "scheduler")
    logger.info("KV connector %s (role %s)", name,
                config.kv_transfer_config.kv_role if config.kv_transfer_config else "kv_both")
    return cls(config, num_gpu_blocks)
