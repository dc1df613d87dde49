"""AsyncLLM: streaming (cumulative / delta / final only), cancellation, abort, concurrency, dead engine.

Plain asyncio.run per test (no pytest-asyncio); one engine serves the whole module, each test
on a fresh event loop, which the client must survive.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import msgspec
import pytest

from minivllm import LLM, AsyncLLM, EngineDeadError, RequestOutputKind, SamplingParams
from minivllm.frontend.async_llm import run
from tests.procs import wait_gone

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)  # runs for many steps
PROMPTS = [f"Stream number {i} says " * (1 + i % 4) for i in range(64)]
N3 = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)  # three different samples
ENGINE_KWARGS = dict(max_num_batched_tokens=64, max_model_len=128)


@pytest.fixture(scope="module")
def llm_results(tiny_llama) -> tuple[list[list[int]], list[tuple[list[int], str]]]:
    """LLM.generate's greedy tokens for PROMPTS, and its n = 3 seeded completions (tokens, text) of
    PROMPTS[4]: what the streams must end with."""
    with LLM(tiny_llama, **ENGINE_KWARGS) as llm:
        greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        fanned = llm.generate(PROMPTS[4], N3, use_tqdm=False)[0].outputs
        return greedy, [(c.token_ids, c.text) for c in fanned]


@pytest.fixture(scope="module")
def expected(llm_results) -> list[list[int]]:
    return llm_results[0]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with AsyncLLM(tiny_llama, **ENGINE_KWARGS) as async_llm:
        yield async_llm


async def collect(engine: AsyncLLM, prompt, params: SamplingParams, request_id: str) -> list:
    return [out async for out in engine.generate(prompt, params, request_id=request_id)]


async def wait_until_idle(engine: AsyncLLM, timeout: float = 5.0) -> None:
    """Until the engine holds no request and no KV block (fails after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.get_stats()
        if stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0:
            assert await engine.get_num_unfinished_requests() == 0
            return
        assert time.monotonic() < deadline, f"the engine still holds requests: {stats}"
        await asyncio.sleep(0.02)


def test_stream_ends_with_the_llm_generate_tokens(engine, expected) -> None:
    outs = asyncio.run(collect(engine, PROMPTS[1], GREEDY, "s1"))
    assert len(outs) > 1  # streamed, not one lump
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths)  # cumulative
    final = outs[-1]
    assert final.request_id == "s1" and final.prompt == PROMPTS[1]
    assert final.outputs[0].token_ids == expected[1] and final.outputs[0].finish_reason == "length"
    tokenizer = engine.tokenizer
    assert final.outputs[0].text == tokenizer.decode(expected[1], skip_special_tokens=True)
    assert all(o.outputs[0].token_ids == expected[1][: len(o.outputs[0].token_ids)] for o in outs)


def test_delta_outputs_concatenate_to_the_cumulative_result(engine, expected) -> None:
    async def main():
        delta = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        final_only = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
        return await asyncio.gather(collect(engine, PROMPTS[2], GREEDY, "cumulative"),
                                    collect(engine, PROMPTS[2], delta, "delta"),
                                    collect(engine, PROMPTS[2], final_only, "final"))

    cumulative, deltas, final = asyncio.run(main())
    assert len(deltas) > 1 and all(d.outputs[0].token_ids for d in deltas)
    assert sum((d.outputs[0].token_ids for d in deltas), []) == cumulative[-1].outputs[0].token_ids == expected[2]
    assert "".join(d.outputs[0].text for d in deltas) == cumulative[-1].outputs[0].text
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == expected[2]
    assert final[0].outputs[0].text == cumulative[-1].outputs[0].text


def test_64_concurrent_streams_all_complete_and_match(engine, expected) -> None:
    async def main():
        return await asyncio.gather(*(collect(engine, p, GREEDY, f"c{i}") for i, p in enumerate(PROMPTS)))

    streams = asyncio.run(main())
    for i, outs in enumerate(streams):
        assert outs[-1].finished and outs[-1].request_id == f"c{i}"
        assert outs[-1].outputs[0].token_ids == expected[i], f"stream {i}"
    assert engine.get_unfinished_request_ids() == []


def test_closing_a_stream_aborts_its_request_at_once(engine) -> None:
    async def main():
        async with contextlib.aclosing(engine.generate(PROMPTS[0], LONG, request_id="closed")) as stream:
            async for out in stream:
                if len(out.outputs[0].token_ids) >= 2:
                    break
        # The abort went out before aclose() returned, ahead of this call on the same socket.
        stats = await engine.get_stats()
        assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)
        assert await engine.get_num_unfinished_requests() == 0

    asyncio.run(main())


def test_breaking_out_or_cancelling_aborts_the_request(engine) -> None:
    async def break_out():
        async for out in engine.generate(PROMPTS[0], LONG, request_id="broken"):
            if len(out.outputs[0].token_ids) >= 2:
                break  # the generator is closed when collected, which aborts the request
        await wait_until_idle(engine)

    async def cancel_task():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(PROMPTS[3], LONG, request_id="cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        assert (await engine.get_stats()).num_running_reqs == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_idle(engine)
        assert engine.get_unfinished_request_ids() == []
        # The id is free again, and the engine keeps serving.
        outs = await collect(engine, PROMPTS[3], GREEDY, "cancelled")
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12

    asyncio.run(break_out())
    asyncio.run(cancel_task())


def test_abort_by_id_ends_the_stream_with_finish_reason_abort(engine) -> None:
    async def main():
        outs = []
        async for out in engine.generate(PROMPTS[0], LONG, request_id="victim"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("victim")
                await engine.abort(["victim", "no-such-request"])  # ignored
        await wait_until_idle(engine)
        return outs

    outs = asyncio.run(main())
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert 2 <= len(final.outputs[0].token_ids) < LONG.max_tokens


def test_bad_input_is_a_value_error_before_the_engine(engine) -> None:
    async def main():
        for prompt, params, message in [
            ("", GREEDY, "empty"),
            ({"prompt_token_ids": [1, 2, 512]}, GREEDY, "outside the vocabulary"),
            ({"prompt_token_ids": [5] * 129}, GREEDY, "max_model_len"),
        ]:
            with pytest.raises(ValueError, match=message):
                await collect(engine, prompt, params, "bad")
        assert engine.get_unfinished_request_ids() == []
        # A second request under a live id is refused; the first one is untouched.
        first = engine.generate(PROMPTS[0], LONG, request_id="dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="already running"):
            await collect(engine, PROMPTS[1], GREEDY, "dup")
        await first.aclose()
        await wait_until_idle(engine)
        outs = await collect(engine, PROMPTS[1], GREEDY, "dup")  # free again
        assert outs[-1].finished

    asyncio.run(main())
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)


def test_runs_on_uvloop_when_installed(engine, expected) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def main():
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        return await collect(engine, PROMPTS[5], GREEDY, "uv")

    assert run(main())[-1].outputs[0].token_ids == expected[5]


@pytest.mark.parametrize("victim", ["worker", "engine"])
def test_dead_engine_raises_engine_dead_error_in_pending_streams(tiny_llama, victim) -> None:
    async_llm = AsyncLLM(tiny_llama, max_model_len=512, max_num_batched_tokens=16)
    info = async_llm.engine_info
    pids = [info.engine_pid, *info.worker_pids]
    # ~500 steps: about half a second for a tiny model on a fast CPU, so the kill comes as soon as
    # every stream has its first token.
    long_job = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    started = [asyncio.Event() for _ in range(8)]

    async def consume(i: int) -> list:
        outs = []
        async for out in async_llm.generate("Hello", long_job, f"r{i}"):
            started[i].set()
            outs.append(out)
        return outs

    async def main():
        streams = [asyncio.create_task(consume(i)) for i in range(8)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=60)
        os.kill(info.worker_pids[0] if victim == "worker" else info.engine_pid, signal.SIGKILL)
        start = time.monotonic()
        results = await asyncio.gather(*streams, return_exceptions=True)
        assert time.monotonic() - start < 10
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):  # stays dead, says so at once
            await collect(async_llm, "Hello", GREEDY, "later")
        assert async_llm.errored

    asyncio.run(main())
    async_llm.shutdown()
    assert wait_gone(pids, timeout=10) == []


def test_streamed_text_never_shows_a_stop_string(engine) -> None:
    full = asyncio.run(collect(engine, PROMPTS[3], GREEDY, "stop-free"))[-1].outputs[0].text
    stop = full[5:7]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop,
                            output_kind=RequestOutputKind.DELTA)
    outs = asyncio.run(collect(engine, PROMPTS[3], params, "stop-delta"))
    assert "".join(o.outputs[0].text for o in outs) == full[: full.find(stop)]
    assert outs[-1].finished and outs[-1].outputs[0].stop_reason == stop
    asyncio.run(wait_until_idle(engine))


def test_n_completions_stream_in_one_request_output_per_step(engine, llm_results) -> None:
    expected = llm_results[1]
    assert len({tuple(tokens) for tokens, _ in expected}) > 1  # the samples differ

    async def main():
        kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]
        return await asyncio.gather(*(
            collect(engine, PROMPTS[4], msgspec.structs.replace(N3, output_kind=kind), f"n3-{int(kind)}")
            for kind in kinds))

    cumulative, deltas, final = asyncio.run(main())
    assert len(final) == 1 and final[0].finished and final[0].request_id == "n3-2"
    for outs in (cumulative, final):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert all([c.index for c in o.outputs] == [0, 1, 2] for o in outs)  # all n, in index order
        assert [(c.token_ids, c.text) for c in outs[-1].outputs] == expected  # as LLM.generate
        assert all(c.finish_reason == "length" for c in outs[-1].outputs)
    assert len(cumulative) > 1 and len(deltas) > 1
    # DELTA: only the completions with something new, each by index; they add up to the whole.
    tokens, text = {0: [], 1: [], 2: []}, {0: "", 1: "", 2: ""}
    for out in deltas:
        assert out.request_id == "n3-1" and out.outputs and len({c.index for c in out.outputs}) == len(out.outputs)
        for c in out.outputs:
            tokens[c.index] += c.token_ids
            text[c.index] += c.text
    assert [(tokens[i], text[i]) for i in range(3)] == expected
    assert deltas[-1].finished and [o.finished for o in deltas].count(True) == 1
    asyncio.run(wait_until_idle(engine))


def test_leaving_or_aborting_an_n_stream_stops_all_its_completions(engine) -> None:
    long_n = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=100, ignore_eos=True)

    async def break_out():
        async for out in engine.generate(PROMPTS[0], long_n, request_id="n-broken"):
            if any(len(c.token_ids) >= 2 for c in out.outputs):
                # All three completions are in the engine. (Not necessarily all running: the
                # children are sent one by one, and on a loaded box the engine answered once with
                # one running and two admitted but not yet scheduled.)
                stats = await engine.get_stats()
                assert stats.num_running_reqs + stats.num_waiting_reqs == 3
                break
        await wait_until_idle(engine)
        assert engine.get_unfinished_request_ids() == []

    async def abort_by_id():
        outs = []
        async for out in engine.generate(PROMPTS[0], long_n, request_id="n-victim"):
            outs.append(out)
            if len(outs) == 2:
                with pytest.raises(ValueError, match="already running"):
                    await collect(engine, PROMPTS[1], GREEDY, "n-victim")
                await engine.abort("n-victim")
        await wait_until_idle(engine)
        return outs

    asyncio.run(break_out())
    final = asyncio.run(abort_by_id())[-1]
    assert final.finished and [c.finish_reason for c in final.outputs] == ["abort"] * 3
    assert all(len(c.token_ids) < long_n.max_tokens for c in final.outputs)
