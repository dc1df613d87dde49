"""Soak the engine boundary: a standalone `minivllm engine` takes hostile traffic for a while
(random frames and bytes, random msgpack, well-formed requests with hostile values, floods past
max_pending_requests, frontends killed mid-generation) while a real frontend keeps checking that
its greedy answers stay token-exact. Prints the figures for the notes:

    messages fuzzed, hostile requests answered with an error, flood size and overload refusals,
    the engine's peak RSS (before / during), time to notice a vanished frontend (SIGKILL ->
    its requests aborted and KV blocks free again).

    python benchmarks/soak_engine.py --duration 600            # tiny random model, CPU
    python benchmarks/soak_engine.py --model DIR --duration 600 --device cuda

The pieces (hostile_messages, Fuzzer, flood, time_to_notice_vanished_frontend, ...) are what
tests/e2e/test_engine_boundary*.py run in short.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import msgspec
import zmq

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINIVLLM = os.path.join(REPO_ROOT, "bin", "minivllm")

# ------------------------------------------------------------------------------ the engine


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def start_engine(model: str, address: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`minivllm engine` at `address` (a child of this process)."""
    return subprocess.Popen([sys.executable, MINIVLLM, "engine", "--model", model, "--address", address, *args],
                            env=env)


def wait_for_engine(address: str, proc: subprocess.Popen, engine_key: str | None = None, timeout: float = 120.0):
    """An attached EngineCoreClient once the engine answers (raises if the engine process exits)."""
    from minivllm.frontend.core_client import EngineCoreClient

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with code {proc.returncode}")
        try:
            return EngineCoreClient.attach(address, timeout=2.0, engine_key=engine_key)
        except ConnectionError:
            if time.monotonic() > deadline:
                raise


def rss_kb(pid: int) -> int:
    """The resident set of a process, in KiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    return 0


class PeakRss:
    """Samples a process's RSS every few ms in a thread; .peak_kb is the largest seen."""

    def __init__(self, pid: int, interval_s: float = 0.005) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak_kb = rss_kb(pid)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak_kb = max(self.peak_kb, rss_kb(self.pid))
            time.sleep(self.interval_s)

    def __enter__(self) -> "PeakRss":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()


# ------------------------------------------------------------------------------ hostile traffic

_TAGS = ["add", "abort", "utility", "bogus", "output", "schedule"]  # never "shutdown": that one is allowed


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([0, -1, 1, 2**31, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if kind == 1:
        return rng.choice([0.0, -0.0, math.nan, math.inf, -math.inf, 1e308, rng.random()])
    if kind == 2:
        return "".join(rng.choice("abc\x00\u00e9\U0001f600") for _ in range(rng.randrange(0, 12)))
    if kind == 3:
        return rng.randbytes(rng.randrange(0, 16))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return rng.choice(_TAGS)
    if kind == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if kind == 7:
        return {rng.choice(["type", "request_id", "prompt_token_ids", "sampling_params", "arrival_time",
                            "request_ids", "call_id", "method", "args", "n", "x"]): _random_value(rng, depth + 1)
                for _ in range(rng.randrange(0, 6))}
    return {"type": rng.choice(_TAGS), "request_id": _random_value(rng, depth + 1),
            "prompt_token_ids": _random_value(rng, depth + 1), "sampling_params": _random_value(rng, depth + 1)}


def hostile_request_values(vocab_size: int, max_model_len: int) -> list[tuple[str, dict[str, Any]]]:
    """(what, fields to put over a valid "add" message): each must be refused as invalid."""
    v = vocab_size
    sp = lambda **kw: {"sampling_params": {"max_tokens": 4, **kw}}  # noqa: E731
    return [
        ("prompt token = vocab", {"prompt_token_ids": [1, v]}),
        ("negative prompt token", {"prompt_token_ids": [-1, 2]}),
        ("huge prompt token", {"prompt_token_ids": [2**63 - 1]}),
        ("uint64 prompt token", {"prompt_token_ids": [2**64 - 1]}),
        ("empty prompt", {"prompt_token_ids": []}),
        ("over-long prompt", {"prompt_token_ids": [1] * (max_model_len + 1)}),
        ("string token", {"prompt_token_ids": ["a"]}),
        ("float token", {"prompt_token_ids": [1.5]}),
        ("n huge", sp(n=10**9)),
        ("n zero", sp(n=0)),
        ("logprobs huge", sp(logprobs=10**6)),
        ("prompt_logprobs negative", sp(prompt_logprobs=-5)),
        ("max_tokens uint64", sp(max_tokens=2**64 - 1)),
        ("max_tokens zero", sp(max_tokens=0)),
        ("min_tokens huge", {"sampling_params": {"max_tokens": None, "min_tokens": 2**62}}),
        ("temperature nan", sp(temperature=math.nan)),
        ("temperature inf", sp(temperature=math.inf)),
        ("top_p nan", sp(top_p=math.nan)),
        ("top_k huge", sp(top_k=2**62)),
        ("logit_bias key out of vocab", sp(logit_bias={v + 5: 1.0})),
        ("logit_bias nan", sp(logit_bias={1: math.nan})),
        ("logit_bias huge", sp(logit_bias={1: 1e30})),
        ("allowed_token_ids out of vocab", sp(allowed_token_ids=[v])),
        ("stop_token_ids out of vocab", sp(stop_token_ids=[10**9], min_tokens=2)),
        ("stop_token_ids too many", sp(stop_token_ids=[1] * 5000)),
        ("empty bad word", sp(_bad_words_token_ids=[[]])),
        ("bad word out of vocab", sp(_bad_words_token_ids=[[1, v]])),
        ("seed negative", sp(seed=-1)),
        ("repetition_penalty zero", sp(repetition_penalty=0.0)),
        ("presence_penalty inf", sp(presence_penalty=math.inf)),
        ("output_kind 7", sp(output_kind=7)),
        ("min_p 2", sp(min_p=2.0)),
        ("eos id out of vocab", {"eos_token_ids": [v * 10], "sampling_params": {"max_tokens": 4, "min_tokens": 2}}),
        ("negative eos id", {"eos_token_ids": [-1]}),
        ("priority under fcfs", {"priority": 5}),
        ("arrival_time nan", {"arrival_time": math.nan}),
        ("cache_salt empty", {"cache_salt": ""}),
        ("cache_salt huge", {"cache_salt": "x" * 5000}),
        ("sampling_params wrong type", {"sampling_params": [1, 2, 3]}),
        ("too big for the KV cache", {"sampling_params": {"max_tokens": None}}),
    ]


class HostileTraffic:
    """Random messages for an engine, as frame lists a DEALER sends. Requests with hostile values
    get ids starting "bad-"; each must be answered with an "invalid" error, alone or in a batch
    (AddRequests) beside valid requests and wrongly typed ones."""

    def __init__(self, seed: int, vocab_size: int, max_model_len: int, kv_capacity: int) -> None:
        self.rng = random.Random(seed)
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.hostile = hostile_request_values(vocab_size, max_model_len)
        # "too big for the KV cache" is only hostile when max_model_len exceeds the cache.
        if max_model_len <= kv_capacity:
            self.hostile = [h for h in self.hostile if h[0] != "too big for the KV cache"]
        self.counter = 0
        self.live_valid_ids: list[str] = []

    def _valid_add(self, request_id: str) -> dict[str, Any]:
        rng = self.rng
        return {"type": "add", "request_id": request_id,
                "prompt_token_ids": [rng.randrange(self.vocab_size) for _ in range(rng.randrange(1, 12))],
                "sampling_params": {"max_tokens": rng.randrange(1, 4), "temperature": rng.choice([0.0, 1.0]),
                                    "seed": rng.randrange(100)},
                "arrival_time": time.time()}

    def _hostile_add(self) -> dict[str, Any]:
        what, fields = self.rng.choice(self.hostile)
        message = self._valid_add(f"bad-{self.counter}-{self.rng.randrange(10**9)}")
        for key, value in fields.items():
            if key == "sampling_params" and isinstance(value, dict):
                message["sampling_params"] = {**message["sampling_params"], **value}
            else:
                message[key] = value
        return message

    def next(self) -> tuple[list[bytes], list[str]]:
        """One message as frames, and the ids of the hostile requests in it."""
        rng = self.rng
        self.counter += 1
        kind = rng.random()
        enc = msgspec.msgpack.encode
        if kind < 0.15:  # random frame counts and bytes
            return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 6))], []
        if kind < 0.25:  # random bytes as one payload
            return [rng.randbytes(rng.randrange(0, 512))], []
        if kind < 0.45:  # random msgpack
            return [enc(_random_value(rng))], []
        if kind < 0.70:  # a well-formed request with a hostile value
            message = self._hostile_add()
            return [enc(message)], [message["request_id"]]
        if kind < 0.80:  # a batch: hostile requests, valid ones, random values
            items, hostile_ids = [], []
            for _ in range(rng.randrange(0, 6)):
                pick = rng.random()
                if pick < 0.5:
                    items.append(self._hostile_add())
                    hostile_ids.append(items[-1]["request_id"])
                elif pick < 0.8:
                    items.append(self._valid_add(f"ok-{self.counter}-{len(items)}"))
                else:
                    items.append(_random_value(rng))
            return [enc({"type": "add_many", "requests": items})], hostile_ids
        if kind < 0.88:  # a valid request that runs (a few tokens), or a duplicate of a live one
            if self.live_valid_ids and rng.random() < 0.2:
                return [enc(self._valid_add(rng.choice(self.live_valid_ids)))], []
            request_id = f"ok-{self.counter}"
            self.live_valid_ids = (self.live_valid_ids + [request_id])[-8:]
            return [enc(self._valid_add(request_id))], []
        if kind < 0.94:  # aborts of ids that may or may not exist
            ids = [rng.choice(self.live_valid_ids + ["nope", ""]) for _ in range(rng.randrange(0, 4))]
            return [enc({"type": "abort", "request_ids": ids})], []
        method = rng.choice(["get_stats", "check_health", "nope", "__init__", "shutdown", "get_engine_info"])
        return [enc({"type": "utility", "call_id": rng.randrange(2**31), "method": method,
                     "args": [_random_value(rng) for _ in range(rng.randrange(0, 3))]})], []


class Fuzzer:
    """Sends HostileTraffic to an engine from a DEALER (a fresh one, so a fresh identity, every
    `reconnect_every` messages) and reads the answers. `keys`: a CurveKeys for a keyed engine."""

    def __init__(self, address: str, traffic: HostileTraffic, keys=None, reconnect_every: int = 1000) -> None:
        self.address, self.traffic, self.keys, self.reconnect_every = address, traffic, keys, reconnect_every
        self.ctx = zmq.Context()
        self.socket: zmq.Socket | None = None
        self.sent = 0
        self.hostile_ids: set[str] = set()
        self.answered: dict[str, tuple[str | None, str | None]] = {}  # request id -> (error_type, error)

    def _connect(self) -> None:
        if self.socket is not None:
            # This identity's answers go only to this socket: before closing it, wait for every
            # hostile request sent on it to be answered (a busy engine may take more than a moment).
            self._drain(0.2)
            self.unanswered()
            self.socket.close(linger=0)
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, 5000)
        if self.keys is not None:
            self.keys.make_client(self.socket)
        self.socket.connect(self.address)

    def _drain(self, wait_s: float = 0.0) -> None:
        from minivllm.protocol.messages import EngineCoreOutputs

        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        deadline = time.monotonic() + wait_s
        while self.socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            message = decoder.decode(self.socket.recv())
            for out in message.outputs:
                if out.finish_reason is not None:
                    self.answered[out.request_id] = (out.error_type, out.error)

    def run(self, count: int) -> None:
        for _ in range(count):
            if self.socket is None or self.sent % self.reconnect_every == 0:
                self._connect()
            frames, hostile_ids = self.traffic.next()
            self.socket.send_multipart(frames)
            self.sent += 1
            self.hostile_ids.update(hostile_ids)
            if self.sent % 50 == 0:
                self._drain()

    def unanswered(self, wait_s: float = 10.0) -> set[str]:
        """Hostile requests with no "invalid" answer yet, after waiting up to wait_s for them."""
        deadline = time.monotonic() + wait_s
        while True:
            missing = {i for i in self.hostile_ids if self.answered.get(i, (None,))[0] != "invalid"}
            if not missing or time.monotonic() > deadline:
                return missing
            self._drain(0.2)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


# ------------------------------------------------------------------------------ flood, vanished frontend


def flood(address: str, count: int, vocab_size: int, keys=None, max_tokens: int = 8,
          answer_timeout_s: float = 60.0) -> dict[str, int]:
    """`count` valid requests as fast as one socket sends them; returns how they were answered:
    finished (served), overloaded, other errors, unanswered."""
    from minivllm.protocol.messages import EngineCoreOutputs

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        keys.make_client(sock)
    sock.connect(address)
    decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
    rng = random.Random(1)
    results = {"served": 0, "overloaded": 0, "other_errors": 0}
    done = 0

    def read(timeout_ms: int) -> None:
        nonlocal done
        while sock.poll(timeout_ms):
            timeout_ms = 0
            for out in decoder.decode(sock.recv()).outputs:
                if out.finish_reason is None:
                    continue
                done += 1
                if out.error_type == "overloaded":
                    results["overloaded"] += 1
                elif out.error_type is not None:
                    results["other_errors"] += 1
                else:
                    results["served"] += 1

    for i in range(count):
        sock.send(msgspec.msgpack.encode({
            "type": "add", "request_id": f"flood-{i}",
            "prompt_token_ids": [rng.randrange(vocab_size) for _ in range(8)],
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
            "arrival_time": time.time()}))
        if i % 64 == 0:
            read(0)
    deadline = time.monotonic() + answer_timeout_s
    while done < count and time.monotonic() < deadline:
        read(200)
    results["unanswered"] = count - done
    ctx.destroy(linger=0)
    return results


_VICTIM = """
import sys
from minivllm import LLM, SamplingParams
llm = LLM(engine_address=sys.argv[1], engine_key=sys.argv[2] or None)
print("attached", flush=True)
llm.generate(["The quick brown fox"] * int(sys.argv[3]),
             SamplingParams(temperature=0.0, max_tokens=int(sys.argv[4]), ignore_eos=True), use_tqdm=False)
print("finished before it was killed", flush=True)
"""


def time_to_notice_vanished_frontend(address: str, observer, engine_key: str | None = None,
                                     num_requests: int = 16, max_tokens: int = 400,
                                     timeout_s: float = 30.0) -> float:
    """Start a frontend in a subprocess, SIGKILL it once its requests run, and return the seconds
    until the engine holds no request and no KV block. `observer`: an attached LLM."""
    victim = subprocess.Popen([sys.executable, "-c", _VICTIM, address, engine_key or "", str(num_requests),
                               str(max_tokens)], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline().strip() == "attached"
        deadline = time.monotonic() + timeout_s
        while observer.get_stats().num_running_reqs < num_requests:
            if time.monotonic() > deadline or victim.poll() is not None:
                raise RuntimeError("the victim frontend's requests never all ran")
            time.sleep(0.01)
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while True:
            stats = observer.get_stats()
            if stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0:
                return time.monotonic() - killed
            if time.monotonic() - killed > timeout_s:
                raise RuntimeError(f"the engine still holds the killed frontend's requests after {timeout_s} s: {stats}")
            time.sleep(0.005)
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait()


# ------------------------------------------------------------------------------ the soak


def run_soak(model: str, duration_s: float, engine_args: list[str] | None = None, seed: int = 0,
             log=print) -> dict[str, Any]:
    """Everything above in rounds for `duration_s` against one keyed engine; returns the figures."""
    from minivllm import LLM, EngineOverloadedError, SamplingParams
    from minivllm.protocol.auth import CurveKeys

    key = os.urandom(24).hex()
    address = free_tcp_address()
    env = dict(os.environ, MINIVLLM_ENGINE_KEY=key, MINIVLLM_LOG_LEVEL=os.environ.get("MINIVLLM_LOG_LEVEL", "WARNING"))
    proc = start_engine(model, address, *(engine_args or []), env=env)
    figures: dict[str, Any] = {"messages_fuzzed": 0, "hostile_requests": 0, "hostile_unanswered": 0,
                               "flood_requests": 0, "flood_overloaded": 0, "flood_served": 0,
                               "flood_unanswered": 0, "checks": 0, "mismatches": 0, "notice_s": []}
    try:
        wait_for_engine(address, proc, key).shutdown()
        llm = LLM(engine_address=address, engine_key=key)
        info = llm.engine_info
        figures["rss_start_kb"] = rss_kb(info.engine_pid)
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        prompts = ["Hello", "The quick brown fox", "What is the capital of France?"]
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        traffic = HostileTraffic(seed, info.vocab_size, info.max_model_len, info.num_gpu_blocks * info.block_size)
        fuzzer = Fuzzer(address, traffic, CurveKeys(key))
        stop = threading.Event()

        def check_answers() -> None:  # the real frontend, all along
            while not stop.is_set():
                try:
                    outs = llm.generate(prompts, greedy, use_tqdm=False)
                except EngineOverloadedError:  # a flood holds the engine: that is the point of it
                    time.sleep(0.05)
                    continue
                figures["checks"] += 1
                figures["mismatches"] += [o.outputs[0].token_ids for o in outs] != reference

        with PeakRss(info.engine_pid) as peak:
            checker = threading.Thread(target=check_answers, daemon=True)
            checker.start()
            start = time.monotonic()
            round_no = 0
            while time.monotonic() - start < duration_s:
                round_no += 1
                fuzzer.run(10_000)
                flood_result = flood(address, 5_000, info.vocab_size, CurveKeys(key))
                figures["flood_requests"] += 5_000
                figures["flood_overloaded"] += flood_result["overloaded"]
                figures["flood_served"] += flood_result["served"]
                figures["flood_unanswered"] += flood_result["unanswered"]
                figures["notice_s"].append(time_to_notice_vanished_frontend(address, llm, key))
                log(f"round {round_no}: {fuzzer.sent} messages fuzzed, flood {flood_result}, "
                    f"vanished frontend noticed in {figures['notice_s'][-1]:.3f} s, "
                    f"engine RSS {rss_kb(info.engine_pid) / 1024:.0f} MiB (peak {peak.peak_kb / 1024:.0f} MiB), "
                    f"{figures['checks']} checks, {figures['mismatches']} mismatches")
            stop.set()
            checker.join()
        figures["messages_fuzzed"] = fuzzer.sent
        figures["hostile_requests"] = len(fuzzer.hostile_ids)
        figures["hostile_unanswered"] = len(fuzzer.unanswered())
        figures["rss_peak_kb"] = peak.peak_kb
        figures["rss_end_kb"] = rss_kb(info.engine_pid)
        figures["engine_alive"] = proc.poll() is None
        fuzzer.close()
        llm.shutdown()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: a tiny random Llama, built here)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of soak (rounds run to completion)")
    parser.add_argument("--max-pending-requests", type=int, default=256)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    model = args.model
    if model is None:
        sys.path.insert(0, REPO_ROOT)
        from tests.tiny_models import build_tiny_model

        model = build_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny-llama"), arch="llama")
    figures = run_soak(model, args.duration, ["--max-model-len", "512", "--device", args.device,
                                              "--max-pending-requests", str(args.max_pending_requests)])
    notice = figures.pop("notice_s")
    print(f"\nmessages fuzzed: {figures['messages_fuzzed']} ({figures['hostile_requests']} hostile requests, "
          f"{figures['hostile_unanswered']} without an 'invalid' answer)")
    print(f"flood: {figures['flood_requests']} requests, {figures['flood_overloaded']} refused as overloaded, "
          f"{figures['flood_served']} served, {figures['flood_unanswered']} unanswered")
    print(f"engine RSS: start {figures['rss_start_kb'] / 1024:.0f} MiB, peak {figures['rss_peak_kb'] / 1024:.0f} MiB, "
          f"end {figures['rss_end_kb'] / 1024:.0f} MiB")
    print(f"vanished frontend noticed (SIGKILL -> no requests, KV free): "
          f"min {min(notice):.3f} s, median {sorted(notice)[len(notice) // 2]:.3f} s, max {max(notice):.3f} s "
          f"over {len(notice)} kills")
    print(f"real frontend: {figures['checks']} token-exact checks, {figures['mismatches']} mismatches; "
          f"engine alive: {figures['engine_alive']}")


if __name__ == "__main__":
    main()
