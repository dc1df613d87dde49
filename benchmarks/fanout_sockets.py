"""How should the EngineCore send each SchedulerOutput to N workers: one PUB socket all workers
SUBscribe to, or one PUSH socket per worker (what core/executor.py does)?

Each worker process receives and decodes every message and acks on a shared PULL socket; the
timer runs from the first send to the last ack, so it is the fan-out's whole cost to the step
(encode once, send, N receives + decodes). Two realistic messages: a decode step of 256 running
requests (deltas only) and an admission step of 256 new requests with 100-1024-token prompts.

    python benchmarks/fanout_sockets.py --workers 2 4 --iters 300
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import statistics
import tempfile
import time
import uuid

import numpy as np
import zmq

from minivllm.protocol.messages import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.serial import encode, worker_input_decoder

logger = logging.getLogger("fanout")


def decode_step(num_reqs: int = 256) -> SchedulerOutput:
    cached = [CachedRequestData(str(i), [1000 + i] if i % 16 == 0 else [], 300 + i) for i in range(num_reqs)]
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={str(i): 1 for i in range(num_reqs)},
                           total_num_scheduled_tokens=num_reqs, finished_req_ids=[])


def admission_step(num_reqs: int = 256, seed: int = 0) -> SchedulerOutput:
    rng = np.random.default_rng(seed)
    new = []
    for i in range(num_reqs):
        length = int(rng.integers(100, 1025))
        new.append(NewRequestData(
            req_id=str(i), prompt_token_ids=rng.integers(0, 151936, length).tolist(), output_token_ids=[],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=256), block_ids=list(range(-(-length // 16))),
            num_computed_tokens=0))
    return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=[],
                           num_scheduled_tokens={str(i): 32 for i in range(num_reqs)},
                           total_num_scheduled_tokens=32 * num_reqs, finished_req_ids=[])


def worker(mode: str, work_address: str, ack_address: str, rank: int) -> None:
    ctx = zmq.Context()
    if mode == "pub":
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(work_address)
    else:
        sock = ctx.socket(zmq.PULL)
        sock.connect(f"{work_address}-{rank}")
    ack = ctx.socket(zmq.PUSH)
    ack.connect(ack_address)
    ack.send(b"hello")  # for pub: keeps re-sending until the subscription is live (slow joiner)
    while True:
        payload = sock.recv()
        if payload == b"stop":
            break
        if payload == b"ping":
            ack.send(str(rank).encode())
            continue
        worker_input_decoder.decode(payload)
        ack.send(b"")
    ctx.destroy(linger=0)


def run(mode: str, num_workers: int, message: SchedulerOutput, iters: int) -> list[float]:
    ctx = zmq.Context()
    base = f"ipc://{tempfile.gettempdir()}/fanout-{uuid.uuid4().hex[:8]}"
    ack = ctx.socket(zmq.PULL)
    ack.bind(f"{base}-ack")
    if mode == "pub":
        pub = ctx.socket(zmq.PUB)
        pub.bind(base)
        socks = [pub]
    else:
        socks = []
        for rank in range(num_workers):
            s = ctx.socket(zmq.PUSH)
            s.bind(f"{base}-{rank}")
            socks.append(s)
    procs = [mp.Process(target=worker, args=(mode, base, f"{base}-ack", r)) for r in range(num_workers)]
    for p in procs:
        p.start()
    for _ in range(num_workers):
        ack.recv()
    if mode == "pub":  # the slow-joiner dance: PUB drops messages until each SUB's subscription lands
        seen: set[bytes] = set()
        while len(seen) < num_workers:
            pub.send(b"ping")
            while ack.poll(20):
                seen.add(ack.recv())
        while ack.poll(200):  # answers to the extra pings
            ack.recv()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        payload = encode(message)
        for s in socks:
            s.send(payload)
        for _ in range(num_workers):
            ack.recv()
        times.append(time.perf_counter() - t0)
    for s in socks:  # one PUB reaches every worker; each PUSH its own
        s.send(b"stop")
    for p in procs:
        p.join(timeout=5)
    ctx.destroy(linger=0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name, message in (("decode step, 256 reqs", decode_step()), ("admission step, 256 new reqs", admission_step())):
        size = len(encode(message))
        for n in args.workers:
            for mode in ("push", "pub"):
                times = run(mode, n, message, args.iters)
                logger.info("%-30s %7.1f KiB  %d workers  %-4s  median %7.1f us  p90 %7.1f us", name, size / 1024,
                            n, mode, 1e6 * statistics.median(times), 1e6 * float(np.percentile(times, 90)))


if __name__ == "__main__":
    main()
