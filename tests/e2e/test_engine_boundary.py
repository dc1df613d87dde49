"""The engine boundary: a standalone engine survives whatever reaches its socket, keeps serving the
frontends that behave, refuses what it must with a clear per-request error, knows its clients
(engine key), sheds load, aborts the requests of a frontend that vanished, and turns a hung
worker into EngineDeadError. The traffic generators are benchmarks/soak_engine.py's."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from benchmarks.soak_engine import (
    MINIVLLM,
    Fuzzer,
    HostileTraffic,
    PeakRss,
    flood,
    free_tcp_address,
    rss_kb,
    start_engine,
    time_to_notice_vanished_frontend,
    wait_for_engine,
)
from minivllm import LLM, EngineDeadError, EngineOverloadedError, SamplingParams
from minivllm.frontend.core_client import EngineCoreClient
from minivllm.protocol.auth import CurveKeys
from minivllm.protocol.messages import EngineCoreOutputs, EngineInfo
from tests.procs import pid_alive, wait_gone

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Hello", "The quick brown fox", "What is the capital of France?"]
KEY = "0123456789abcdef-test-engine-key"
MAX_PENDING = 16


@contextlib.contextmanager
def raw_peer(address: str) -> Iterator[zmq.Socket]:
    """A bare DEALER connected to the engine, as any peer could be; gone (without lingering on a
    send, should an assert fail) when the block ends."""
    ctx = zmq.Context()
    ctx.linger = 0
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(address)
        yield sock
    finally:
        ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def open_engine(tiny_llama):
    """A standalone engine without a key (loopback), default admission bound."""
    address = free_tcp_address()
    proc = start_engine(tiny_llama, address, "--max-model-len", "512")
    wait_for_engine(address, proc).shutdown()
    yield address, proc
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def keyed_engine(tiny_llama, tmp_path_factory):
    """A standalone engine with a key file and a small admission bound."""
    key_file = tmp_path_factory.mktemp("key") / "engine.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    address = free_tcp_address()
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_ENGINE_KEY"}
    proc = start_engine(tiny_llama, address, "--max-model-len", "128", "--engine-key-file", str(key_file),
                        "--max-pending-requests", str(MAX_PENDING), env=env)
    wait_for_engine(address, proc, KEY).shutdown()
    yield address, proc
    proc.terminate()
    proc.wait(timeout=20)


def test_fuzz_10k_messages_while_a_frontend_gets_token_exact_answers(open_engine) -> None:
    address, proc = open_engine
    llm = LLM(engine_address=address)
    reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    info = llm.engine_info
    fuzzer = Fuzzer(address, HostileTraffic(0, info.vocab_size, info.max_model_len,
                                            info.num_gpu_blocks * info.block_size))
    try:
        for _ in range(10):  # 10 x 1,000 messages, a real generate between each
            fuzzer.run(1_000)
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == reference
        assert fuzzer.sent >= 10_000
        # Every well-formed request with a hostile value got an "invalid" answer with a reason.
        assert len(fuzzer.hostile_ids) > 2_000
        assert fuzzer.unanswered() == set()
        errors = [fuzzer.answered[i][1] for i in fuzzer.hostile_ids]
        assert any("outside the vocabulary; ids must be in [0, 512)" in e for e in errors)
        assert any("n must be an integer in [1, 128]" in e for e in errors)
        assert any("logprobs must be" in e for e in errors)
    finally:
        fuzzer.close()
    assert proc.poll() is None
    # The fuzzer's valid requests all ended: nothing is held any more.
    deadline = time.monotonic() + 10
    while (stats := llm.get_stats()).num_running_reqs + stats.num_waiting_reqs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats.kv_cache_usage == 0.0
    llm.shutdown()


def test_engine_refusal_raises_value_error_with_the_engines_message(open_engine) -> None:
    """A frontend whose checks are out of date (here: it believes in a larger vocabulary) still
    gets a ValueError: the engine's."""
    address, _ = open_engine
    with LLM(engine_address=address) as llm:
        from dataclasses import replace

        llm.input_processor.limits = replace(llm.input_processor.limits, vocab_size=10_000)
        with pytest.raises(ValueError, match=r"prompt token 600 is outside the vocabulary; ids must be in \[0, 512\)"):
            llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1, 600]}], GREEDY, use_tqdm=False)
        # The rest of the batch was aborted; the next generate runs as usual.
        assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"
        assert llm.get_unfinished_request_ids() == []


def test_malformed_frames_get_no_answer_and_break_nothing(open_engine) -> None:
    address, proc = open_engine
    with raw_peer(address) as sock:
        for frames in ([b""], [b"a", b"b"], [b"x"] * 5, [b"\xc1"], [msgspec.msgpack.encode({"type": "add"})]):
            sock.send_multipart(frames)
        # An abort of somebody else's (or nobody's) request id changes nothing.
        sock.send(msgspec.msgpack.encode({"type": "abort", "request_ids": ["not-mine"]}))
        sock.send(msgspec.msgpack.encode({"type": "utility", "call_id": 7, "method": "check_health", "args": []}))
        # Skip empty outputs: after a peer disconnects (the previous test's frontend) the engine probes
        # every connected peer with one, to learn which is gone.
        deadline = time.monotonic() + 5
        while True:
            assert sock.poll(max(0.0, deadline - time.monotonic()) * 1000)
            answer = msgspec.msgpack.decode(sock.recv(), type=EngineCoreOutputs)
            if answer != EngineCoreOutputs():
                break
        assert answer.utility_result.call_id == 7 and answer.utility_result.result is True
    assert proc.poll() is None


def _raw_add(request_id: str, prompt: list[int], max_tokens: int) -> dict:
    return {"type": "add", "request_id": request_id, "prompt_token_ids": prompt, "arrival_time": time.time(),
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}


def _finished_by_message(sock: zmq.Socket, count: int, timeout_s: float = 30.0) -> dict[str, tuple[int, object]]:
    """Read outputs until `count` requests finished: request id -> (which message, its last output)."""
    finished, index = {}, 0
    deadline = time.monotonic() + timeout_s
    while len(finished) < count:
        assert sock.poll(max(0.0, deadline - time.monotonic()) * 1000), f"only {sorted(finished)} finished"
        answer = msgspec.msgpack.decode(sock.recv(), type=EngineCoreOutputs)
        if answer == EngineCoreOutputs():  # a liveness probe (see above)
            continue
        index += 1
        for out in answer.outputs:
            if out.finish_reason is not None:
                finished[out.request_id] = (index, out)
    return finished


def test_a_batch_starts_in_one_step_and_each_request_is_judged_alone(open_engine) -> None:
    """AddRequests, what LLM.generate sends: the batch's steps are those of the whole batch, so the
    valid requests' one-token answers come back in one message (sent one by one, the first starts
    alone). In the same batch a request with a hostile value and a wrongly typed one are
    each refused with their reason, and random values are dropped."""
    address, proc = open_engine
    with raw_peer(address) as sock:
        for attempt in range(5):
            valid = [_raw_add(f"batch{attempt}-{i}", [i + 1] * (i + 2), max_tokens=1) for i in range(6)]
            hostile = _raw_add(f"hostile{attempt}", [1, 10**6], max_tokens=1)
            mistyped = {**_raw_add(f"mistyped{attempt}", [1], max_tokens=1), "prompt_token_ids": "not ids"}
            sock.send(msgspec.msgpack.encode({"type": "add_many", "requests": [
                *valid[:3], hostile, 17, mistyped, *valid[3:]]}))
            finished = _finished_by_message(sock, 8)
            messages = {finished[r["request_id"]][0] for r in valid}
            assert len(messages) == 1, f"the batch's answers came in {len(messages)} messages"
            for r in valid:
                out = finished[r["request_id"]][1]
                assert out.finish_reason == "length" and out.error is None and len(out.new_token_ids) == 1
            out = finished[f"hostile{attempt}"][1]
            assert out.error_type == "invalid" and "outside the vocabulary; ids must be in [0, 512)" in out.error
            out = finished[f"mistyped{attempt}"][1]
            assert out.error_type == "invalid" and out.error.startswith("invalid request: ")
    assert proc.poll() is None


SMALL_STEP = 64


@pytest.fixture(scope="module")
def small_step_engine(tiny_llama):
    """A standalone engine whose steps take 64 tokens, so a batch of a few hundred prompt tokens
    reaches its busy loop in parts."""
    address = free_tcp_address()
    proc = start_engine(tiny_llama, address, "--max-model-len", "512", "--max-num-batched-tokens", str(SMALL_STEP))
    wait_for_engine(address, proc).shutdown()
    yield address, proc
    proc.terminate()
    proc.wait(timeout=20)


def test_a_batch_read_in_parts_runs_the_steps_of_the_whole_batch(small_step_engine) -> None:
    """A batch of many steps' prompt tokens is decoded and admitted request by request and reaches
    the scheduler in parts, its first step starting while the rest is read; the scheduler waits for
    the next part whenever it would look past the last one in. So the steps are those of the whole
    batch: with one-token answers, the requests that finish together are exactly those whose
    prompts end in the same 64-token step of the batch's prompts laid end to end. A request refused
    in a later part is answered with its reason and changes nothing else. (Here the parts come
    faster than the steps; test_scheduler's test_a_batch_coming_in_parts_is_scheduled_as_if_whole
    varies when they come.)"""
    address, proc = small_step_engine
    with raw_peer(address) as sock:
        for attempt in range(3):
            lengths = [5 + (7 * i + 3 * attempt) % 37 for i in range(60)]  # ~1,400 tokens: ~22 steps
            # (no two prompts start alike, in this batch or an earlier one: no prefix-cache hits)
            valid = [_raw_add(f"parts{attempt}-{i}", [1 + (100 * attempt + i + j) % 500 for j in range(n)],
                              max_tokens=1) for i, n in enumerate(lengths)]
            hostile = _raw_add(f"parts-hostile{attempt}", [1, 10**6], max_tokens=1)
            items = [*valid[:40], hostile, *valid[40:]]
            sock.send(msgspec.msgpack.encode({"type": "add_many", "requests": items}))
            finished = _finished_by_message(sock, len(items))
            ends = itertools.accumulate(lengths)
            expected = [[r["request_id"] for r, end in group]
                        for _, group in itertools.groupby(zip(valid, ends), key=lambda pair: (pair[1] - 1) // SMALL_STEP)]
            got = [[r["request_id"] for r in valid if finished[r["request_id"]][0] == index]
                   for index in sorted({finished[r["request_id"]][0] for r in valid})]
            assert got == expected
            assert all(len(finished[r["request_id"]][1].new_token_ids) == 1 for r in valid)
            out = finished[f"parts-hostile{attempt}"][1]
            assert out.error_type == "invalid" and "outside the vocabulary" in out.error
    assert proc.poll() is None


def test_killed_frontend_has_its_requests_aborted_and_blocks_freed(open_engine) -> None:
    address, _ = open_engine
    with LLM(engine_address=address) as observer:
        seconds = time_to_notice_vanished_frontend(address, observer, num_requests=8, max_tokens=400)
        print(f"vanished frontend noticed in {seconds:.3f} s")
        stats = observer.get_stats()
        assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
        assert observer.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_auth_no_key_and_wrong_key_are_refused_right_key_works(keyed_engine, monkeypatch) -> None:
    address, proc = keyed_engine
    monkeypatch.delenv("MINIVLLM_ENGINE_KEY", raising=False)
    with pytest.raises(ConnectionError, match="could not authenticate.*without an engine key"):
        EngineCoreClient.attach(address, timeout=10)
    with pytest.raises(ConnectionError, match="could not authenticate.*with an engine key"):
        LLM(engine_address=address, engine_key="the-wrong-key-of-enough-length")
    # A raw peer without the key gets nothing through: its messages never reach the engine.
    with raw_peer(address) as sock:
        sock.send(msgspec.msgpack.encode({"type": "shutdown"}))
        assert not sock.poll(1000)
    assert proc.poll() is None
    monkeypatch.setenv("MINIVLLM_ENGINE_KEY", KEY)  # the default key source
    with LLM(engine_address=address) as llm:
        assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_refused_handshake_before_the_first_send_is_an_error_not_a_hang(keyed_engine, monkeypatch) -> None:
    """The engine refuses the handshake before the client's first message (a slow client): the
    call fails with the reason, and does not block. (A full suite once hung in the blocking send
    of the test above, on a busy box; this does not reproduce that, but pins the outcome.)"""
    address, proc = keyed_engine
    monkeypatch.delenv("MINIVLLM_ENGINE_KEY", raising=False)
    client = EngineCoreClient(address, owns_engine=False)
    time.sleep(1.5)  # the refused handshake happens now, before anything is sent
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            client.call_utility("get_engine_info", type=EngineInfo, timeout=10)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 (handed to the test thread)
            outcome.append(e)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(30)
    assert not caller.is_alive(), "the call hung"
    assert isinstance(outcome[0], EngineDeadError) and "could not authenticate" in str(outcome[0])
    client.shutdown()  # attached (owns_engine=False): detaches, the engine keeps running
    assert proc.poll() is None


def test_flood_is_refused_as_overloaded_with_bounded_memory(keyed_engine) -> None:
    address, proc = keyed_engine
    with LLM(engine_address=address, engine_key=KEY) as llm:
        pid = llm.engine_info.engine_pid
        assert llm.engine_info.max_pending_requests == MAX_PENDING
        before = rss_kb(pid)
        with PeakRss(pid) as peak:
            result = flood(address, 5_000, llm.engine_info.vocab_size, CurveKeys(KEY), max_tokens=32)
        print(f"flood of 5000: {result}; engine RSS {before // 1024} MiB -> peak {peak.peak_kb // 1024} MiB")
        assert result["unanswered"] == 0 and result["other_errors"] == 0
        assert result["overloaded"] > 4_000 and result["served"] >= MAX_PENDING
        assert peak.peak_kb - before < 100 * 1024  # a few thousand requests queued would not fit
        # A batch larger than the bound goes through LLM.generate in windows.
        outs = llm.generate(["Hello"] * (3 * MAX_PENDING), GREEDY, use_tqdm=False)
        assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1

        # With the engine full of somebody else's requests, a new one is refused as overloaded. The
        # hog sends one batch past the bound: the requests past it are refused, each on its own.
        hog = zmq.Context()
        sock = hog.socket(zmq.DEALER)
        CurveKeys(KEY).make_client(sock)
        sock.connect(address)
        sock.send(msgspec.msgpack.encode({"type": "add_many", "requests": [
            _raw_add(f"hog-{i}", [1, 2, 3], max_tokens=100) for i in range(MAX_PENDING + 4)]}))
        refused = _finished_by_message(sock, 4)
        assert sorted(refused) == [f"hog-{i}" for i in range(MAX_PENDING, MAX_PENDING + 4)]
        assert all(out.error_type == "overloaded" for _, out in refused.values())
        deadline = time.monotonic() + 10
        while (s := llm.get_stats()).num_running_reqs + s.num_waiting_reqs < MAX_PENDING:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(EngineOverloadedError, match="max_pending_requests=16"):
            llm.generate("Hello", GREEDY, use_tqdm=False)
        hog.destroy(linger=0)  # the hog vanishes: its requests are aborted, the engine serves again
        deadline = time.monotonic() + 10
        while True:
            try:
                out = llm.generate("Hello", GREEDY, use_tqdm=False)[0]
                break
            except EngineOverloadedError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert out.outputs[0].finish_reason == "length"
    assert proc.poll() is None


def test_non_loopback_bind_without_key_refuses_to_start(tiny_llama) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_ENGINE_KEY"}
    result = subprocess.run([sys.executable, MINIVLLM, "engine", "--model", tiny_llama, "--address",
                             "tcp://0.0.0.0:5999"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "refusing to serve at tcp://0.0.0.0:5999 without an engine key" in result.stderr


def test_step_watchdog_turns_a_hung_worker_into_engine_dead_error(tiny_llama) -> None:
    llm = LLM(tiny_llama, max_model_len=128, execute_model_timeout_seconds=2.0)
    worker_pid = llm.engine_info.worker_pids[0]
    engine_pid = llm.engine_info.engine_pid
    try:
        assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"
        os.kill(worker_pid, signal.SIGSTOP)  # a real hang: the process lives but never answers
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"step watchdog: no answer from the workers after 2\.\d s"):
            llm.generate("Hello", GREEDY, use_tqdm=False)
        print(f"hang reported after {time.monotonic() - start:.1f} s")
        assert wait_gone([worker_pid, engine_pid], timeout=20) == []
    finally:
        if pid_alive(worker_pid):
            os.kill(worker_pid, signal.SIGCONT)
        llm.shutdown()
