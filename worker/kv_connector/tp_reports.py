"""With tensor parallelism every rank moves its own shard of a request's KV (its KV heads), but only
rank 0's report reaches the scheduler. A transfer is done only when every rank's shard is: this
combines the ranks' reports so that rank 0 reports a request once all ranks have finished with it
(failed if any rank failed, so no rank still writes into blocks the scheduler frees).

Every rank runs the same steps with the same metadata, so all of them know which transfers are
outstanding; the ranks exchange their reports (msgpack bytes, all-gathered over a gloo group of
their own) only while some are, so an idle connector costs no collective.
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(tuple[list[str], list[str], dict[str, str]]).decode


class TPReportCombiner:
    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        # A CPU group beside the model's (which is NCCL on GPUs); every rank makes it at the same
        # point (cache registration), as new_group requires.
        self.group = dist.new_group(backend="gloo")
        self.outstanding_recv: set[str] = set()
        self.outstanding_send: set[str] = set()
        # request id -> ranks done with it so far (and, for pulls, why the failed ones failed)
        self.recv_done: dict[str, dict[int, str | None]] = {}
        self.send_done: dict[str, set[int]] = {}

    def started(self, recv_ids: list[str], send_ids: list[str]) -> None:
        self.outstanding_recv.update(recv_ids)
        self.outstanding_send.update(send_ids)

    def forget(self, req_ids: list[str]) -> None:
        """The scheduler gave up on these (freed their blocks): nothing more is reported of them."""
        for req_id in req_ids:
            self.outstanding_recv.discard(req_id)
            self.outstanding_send.discard(req_id)
            self.recv_done.pop(req_id, None)
            self.send_done.pop(req_id, None)

    def combine(self, sent: set[str], received: set[str], failed: dict[str, str]) -> tuple[set[str], set[str], dict[str, str]]:
        """This rank's news in, the requests every rank is done with out (the same on every rank)."""
        if not (self.outstanding_recv or self.outstanding_send):
            return set(), set(), {}
        mine = _encode((sorted(sent), sorted(received), failed))
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.tp_size)]
        dist.all_gather(sizes, torch.tensor([len(mine)], dtype=torch.int64), group=self.group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.tp_size)]
        dist.all_gather(gathered, padded, group=self.group)
        for rank, (tensor, size) in enumerate(zip(gathered, sizes)):
            rank_sent, rank_received, rank_failed = _decode(tensor[:int(size.item())].numpy().tobytes())
            for req_id in rank_sent:
                if req_id in self.outstanding_send:
                    self.send_done.setdefault(req_id, set()).add(rank)
            for req_id in rank_received:
                if req_id in self.outstanding_recv:
                    self.recv_done.setdefault(req_id, {})[rank] = None
            for req_id, why in rank_failed.items():
                if req_id in self.outstanding_recv:
                    self.recv_done.setdefault(req_id, {})[rank] = f"rank {rank}: {why}"
        done_sending = {r for r, ranks in self.send_done.items() if len(ranks) == self.tp_size}
        done_receiving, failed_receiving = set(), {}
        for req_id, ranks in self.recv_done.items():
            if len(ranks) == self.tp_size:
                errors = [why for why in ranks.values() if why is not None]
                if errors:
                    failed_receiving[req_id] = "; ".join(errors)
                else:
                    done_receiving.add(req_id)
        for req_id in done_sending:
            del self.send_done[req_id]
            self.outstanding_send.discard(req_id)
        for req_id in (*done_receiving, *failed_receiving):
            del self.recv_done[req_id]
            self.outstanding_recv.discard(req_id)
        return done_sending, done_receiving, failed_receiving
