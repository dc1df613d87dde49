"""KV transfer GPU to GPU (the P2pNcclConnector's transport) with the GPUs idle and with both busy.

    python benchmarks/pd_transfer.py [--layers 36] [--tokens 5000] [--pulls 8] [--chunk-mib 64,256] [--json PATH]

A producer's paged cache on cuda:0 and a consumer's on cuda:1, in one process as in a worker
(the server and puller threads beside it); Qwen3-8B's KV shape by default (8 KV heads of 128,
bf16). Each pull moves one request's blocks. "busy": a thread on each GPU keeps it running
8192x8192 matmuls on the default stream, as a prefill or decode step would, while the pulls run;
that is what the 1P1D serving run sees. Both with the transfer's streams at normal priority and
at high priority (the transport's default); for each staging chunk size in --chunk-mib (the
transport's CHUNK_BYTES: fewer, larger chunks mean fewer kernels in a row). Needs two CUDA devices.

NCCL moves point-to-point data with kernels of its own, which wait for SMs like any other; run it
again with NCCL_P2P_USE_CUDA_MEMCPY=1 in the environment to have NCCL use the copy engines instead
(NCCL reads it once per process, hence a second run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch

from minivllm.worker.kv_connector import pd_nccl_transport, pd_zmq_transport
from minivllm.worker.kv_connector.pd_nccl_transport import NcclBlockPuller, NcclBlockServer
from minivllm.worker.kv_connector.pd_zmq_transport import PullJob

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.pd_procs import wait_for_pull  # noqa: E402


def busy(device: str, stop: threading.Event) -> None:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(8):
            a @ a
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace, chunk_mib: int, high_priority: bool, loaded: bool, port: int) -> dict:
    pd_zmq_transport.HIGH_PRIORITY = high_priority
    pd_nccl_transport.CHUNK_BYTES = chunk_mib << 20
    num_blocks = args.tokens // 16 * 2 + 64
    shape = (args.layers, 2, num_blocks, 16, 8, 128)  # views of one tensor, as a worker allocates them
    producer = list(torch.randn(shape, device="cuda:0", dtype=torch.bfloat16).unbind(0))
    consumer = list(torch.zeros(shape, device="cuda:1", dtype=torch.bfloat16).unbind(0))
    server = NcclBlockServer(producer, "127.0.0.1", port)
    puller = NcclBlockPuller(consumer, timeout_s=60.0)
    stop = threading.Event()
    threads = [threading.Thread(target=busy, args=(d, stop), daemon=True) for d in ("cuda:0", "cuda:1")]
    seconds = []
    try:
        remote = torch.randperm(num_blocks)[:args.tokens // 16].tolist()
        local = torch.randperm(num_blocks)[:args.tokens // 16].tolist()
        for i in range(args.pulls + 1):  # the first makes the pair group: not counted
            if i == 1 and loaded:
                for t in threads:
                    t.start()
                time.sleep(0.5)
            server.hold(f"p{i}", remote)
            start = time.perf_counter()
            puller.start(PullJob(f"d{i}", f"p{i}", f"tcp://127.0.0.1:{port}", remote, local))
            done, failed = wait_for_pull(puller, timeout=120.0, interval=0.0005)
            assert not failed, failed
            if i:
                seconds.append(time.perf_counter() - start)
    finally:
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join()
        puller.close()
        server.close()
    moved = sum(c[:, remote].numel() * c.element_size() for c in producer)
    seconds.sort()
    median = seconds[len(seconds) // 2]
    return {"chunk_mib": chunk_mib, "high_priority": high_priority, "busy": loaded, "gigabytes": moved / 1e9, "median_ms": median * 1e3,
            "gb_per_s": moved / median / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--tokens", type=int, default=5000)
    parser.add_argument("--pulls", type=int, default=8)
    parser.add_argument("--chunk-mib", default="64", help="comma-separated staging chunk sizes (MiB)")
    parser.add_argument("--port", type=int, default=29650)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs two CUDA devices")
        return 0
    rows = []
    cases = [(int(c), high, loaded) for c in args.chunk_mib.split(",") for high in (False, True)
             for loaded in (False, True)]
    for n, (chunk_mib, high, loaded) in enumerate(cases):
        rows.append(measure(args, chunk_mib, high, loaded, args.port + n))
        r = rows[-1]
        print(f"chunk {chunk_mib:4} MiB, priority {'high' if high else 'normal':6}, GPUs {'busy' if loaded else 'idle':4}: "
              f"{r['gigabytes']:.2f} GB in {r['median_ms']:.1f} ms = {r['gb_per_s']:.1f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
