"""Prefill/decode disaggregation, scheduler side (pure Python, as the rest of core/).

The kv_transfer_params protocol is vLLM's (NixlConnector's names):
  a prefill request carries {"do_remote_decode": true}; when it finishes, this instance (the KV
  producer) keeps its blocks (delayed free; its workers serve them from the step that completes
  the prompt on, so a decode instance's pull need not wait for the step after the one that sees
  the request finish, a whole prefill step on a loaded producer) and answers with
      {"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id", "remote_request_id",
       "remote_block_ids", "remote_host", "remote_port", "tp_size"};
  a decode request carrying those waits in WAITING_FOR_REMOTE_KVS while this instance's workers
  (the KV consumer) pull the blocks into blocks allocated for it, then runs.
The producer's answer also carries "first_output_token_id", the token its prefill sampled. The
consumer pulls the KV of the whole prompt and starts from that token, so its steps are the ones a
colocated instance would run (bit for bit: no forward of the last prompt token in a different
shape). Requests that ask for logprobs (which the token does not bring) and answers without it
recompute the last prompt token instead, for the logits of the first output token.
Blocks this instance already has in its prefix cache are not pulled again.

The connector only validates and plans; the workers move the bytes (worker/kv_connector/pd_*).
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any, Callable

import msgspec

from minivllm.core.kv_connector.base import KVConnectorSchedulerBase
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.kv_transfer import KVConnectorOutput

logger = logging.getLogger(__name__)

MAX_REMOTE_BLOCKS = 1 << 20


class RecvSpec(msgspec.Struct, array_like=True):
    """Pull a request's blocks: the producer's (remote) into this instance's (local), same order."""

    req_id: str
    remote_req_id: str
    remote_host: str
    remote_port: int  # rank r pulls from remote_port + r
    remote_block_ids: list[int]
    local_block_ids: list[int]


class SendSpec(msgspec.Struct, array_like=True):
    """Hold a finished prefill's blocks for a consumer to pull."""

    req_id: str
    block_ids: list[int]


class PDConnectorMetadata(msgspec.Struct, kw_only=True):
    """What the workers' connectors are told with one step: pulls to start, blocks to serve from
    this step's forward on, and holds to drop before it (their requests lost the blocks)."""

    reqs_to_recv: list[RecvSpec] = []
    reqs_to_send: list[SendSpec] = []
    reqs_to_release: list[str] = []


def parse_remote_prefill(params: dict[str, Any], num_prompt_tokens: int, block_size: int,
                         tp_size: int = 1, vocab_size: int = 1 << 31) -> dict[str, Any]:
    """A decode request's kv_transfer_params, checked (they come from the client): a ValueError
    says what is wrong."""
    remote_tp = params.get("tp_size", 1)
    if remote_tp != tp_size:
        # Rank r pulls shard r (its KV heads) from the producer's rank r: the shards must match.
        raise ValueError(f"the prefill instance runs tensor_parallel_size={remote_tp!r} and this one {tp_size}: "
                         "prefill and decode instances need the same tensor_parallel_size")
    for key, kind in (("remote_request_id", str), ("remote_host", str), ("remote_port", int),
                      ("remote_block_ids", list)):
        value = params.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"kv_transfer_params[{key!r}] must be a {kind.__name__} (as the prefill instance's "
                             f"answer gives it), got {value!r:.80}")
    if not 0 < params["remote_port"] < 65536:
        raise ValueError(f"kv_transfer_params['remote_port'] must be in [1, 65535], got {params['remote_port']}")
    block_ids = params["remote_block_ids"]
    expected = math.ceil(num_prompt_tokens / block_size)
    if len(block_ids) != expected:
        raise ValueError(f"kv_transfer_params['remote_block_ids'] has {len(block_ids)} blocks; a {num_prompt_tokens}-"
                         f"token prompt fills {expected} blocks of {block_size} (same prompt and block size as the "
                         "prefill instance?)")
    if any(not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < MAX_REMOTE_BLOCKS for b in block_ids):
        raise ValueError("kv_transfer_params['remote_block_ids'] must be non-negative block ids")
    token = params.get("first_output_token_id")
    if token is not None and (not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size):
        raise ValueError(f"kv_transfer_params['first_output_token_id'] must be a token id in [0, {vocab_size}), "
                         f"got {token!r:.80}")
    return params


class PDConnectorScheduler(KVConnectorSchedulerBase):
    """The scheduler side for kv_role kv_producer (prefill) or kv_consumer (decode); kv_both does
    both. See core/kv_connector/base.py for when the Scheduler calls what."""

    def __init__(self, config: EngineConfig, num_gpu_blocks: int) -> None:
        super().__init__(config, num_gpu_blocks)
        transfer = config.kv_transfer_config
        self.host = transfer.kv_ip
        self.port = transfer.kv_port
        self.tp_size = config.tensor_parallel_size
        self.engine_id = str(transfer.kv_connector_extra_config.get("engine_id") or uuid.uuid4())
        self._to_recv: list[RecvSpec] = []
        self._to_send: list[SendSpec] = []
        # Decode requests whose KV is being pulled.
        self._loading: set[str] = set()
        self._matched: dict[str, int] = {}  # request id -> tokens cached here, between the two calls above
        self._holding: set[str] = set()  # finished prefills whose blocks wait to be pulled
        # Prefills for a decode instance (do_remote_decode) whose prompt is not computed yet, and
        # those whose workers already serve the prompt's blocks (held before they finished).
        self._prefilling: dict[str, Any] = {}
        self._held_early: dict[str, list[int]] = {}  # id -> the prompt's blocks its workers serve
        self._to_release: list[str] = []
        self._block_ids: Callable[[str], list[int]] | None = None

    def bind_block_ids(self, get_block_ids: Callable[[str], list[int]]) -> None:
        self._block_ids = get_block_ids

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def validate_kv_transfer_params(self, request: Any) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_prefill"):
            if not self.consumes:
                raise ValueError("this instance is no KV consumer (start it with --kv-transfer-role consumer) "
                                 "but the request asks to pull its KV (do_remote_prefill)")
            parse_remote_prefill(params, len(request.prompt_token_ids), self.block_size, self.tp_size,
                                 self.config.vocab_size)
        if params.get("do_remote_decode"):
            if not self.produces:
                raise ValueError("this instance is no KV producer (start it with --kv-transfer-role producer) "
                                 "but the request asks to keep its KV for a decode instance (do_remote_decode)")
            self._prefilling[request.request_id] = request  # (the scheduler adds it next)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or request.request_id in self._loading:
            return 0, False
        # Pulled once: a request preempted later recomputes like any other.
        if getattr(request, "num_preemptions", 0):
            return 0, False
        count = len(request.prompt_token_ids) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._matched[request.request_id] = num_computed_tokens
        return count, True

    def first_output_token(self, request: Any) -> int | None:
        params = request.kv_transfer_params
        if (not params or not params.get("do_remote_prefill") or request.output_token_ids
                or request.sampling_params.logprobs is not None):
            return None
        return params.get("first_output_token_id")

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or num_external_tokens == 0:
            return
        # The external tokens are [c, c + n), c = the locally cached prefix (whole blocks): pull the
        # blocks that hold them, into the blocks at the same positions here.
        first_token = self._matched.pop(request.request_id, 0)
        first, end = first_token // self.block_size, math.ceil((first_token + num_external_tokens) / self.block_size)
        remote = params["remote_block_ids"]
        self._loading.add(request.request_id)
        self._to_recv.append(RecvSpec(request.request_id, params["remote_request_id"], params["remote_host"],
                                      params["remote_port"], list(remote[first:end]), list(block_ids[first:end])))

    def request_preempted(self, request: Any, block_ids: list[int], num_computed_tokens: int) -> None:
        if self._held_early.pop(request.request_id, None) is not None:  # its blocks go to others
            self._to_release.append(request.request_id)  # the workers stop serving them
            self._prefilling[request.request_id] = request  # held again once recomputed

    def build_connector_meta(self, scheduler_output: Any) -> PDConnectorMetadata | None:
        self._hold_computed_prompts(scheduler_output)
        if not self._to_recv and not self._to_send and not self._to_release:
            return None
        meta = PDConnectorMetadata(reqs_to_recv=self._to_recv, reqs_to_send=self._to_send,
                                   reqs_to_release=self._to_release)
        self._to_recv, self._to_send, self._to_release = [], [], []
        return meta

    def _hold_computed_prompts(self, scheduler_output: Any) -> None:
        """Prefills whose prompt this step completes: their workers serve the prompt's blocks
        from this step's forward on (a decode instance only learns of them once they finished)."""
        for req_id, request in list(self._prefilling.items()):
            if req_id not in scheduler_output.num_scheduled_tokens:
                continue
            if request.num_computed_tokens >= request.num_prompt_tokens:  # (counting this step's)
                del self._prefilling[req_id]
                num_blocks = math.ceil(request.num_prompt_tokens / self.block_size)
                held = self._held_early[req_id] = list(self._block_ids(req_id)[:num_blocks])
                self._to_send.append(SendSpec(req_id, held))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in (*output.finished_recving, *output.failed_recving):
            self._loading.discard(req_id)
        self._holding.difference_update(output.finished_sending)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """A finished prefill (do_remote_decode) keeps its prompt's blocks for the consumer, and
        its answer says where they are."""
        self._loading.discard(request.request_id)
        self._matched.pop(request.request_id, None)
        self._prefilling.pop(request.request_id, None)
        held = self._held_early.pop(request.request_id, None)
        if held is None:  # no prefill for a decode instance, or one whose prompt was never computed
            return False, None
        if request.finish_reason not in ("length", "stop"):
            self._to_release.append(request.request_id)  # aborted / failed prefills keep nothing
            return False, None
        self._holding.add(request.request_id)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                      "remote_request_id": request.request_id, "remote_block_ids": held,
                      "remote_host": self.host, "remote_port": self.port, "tp_size": self.tp_size,
                      "first_output_token_id": request.output_token_ids[0] if request.output_token_ids else None}

    def has_pending_work(self) -> bool:
        # Held blocks are released (and consumer pulls complete) only through worker reports.
        return bool(self._loading or self._holding)
