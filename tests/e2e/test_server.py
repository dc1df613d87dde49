"""`minivllm serve` through the real `openai` client: completions and chat, whole and streamed,
n > 1, seeds, logprobs, stop strings, usage, errors, the API key, the in-flight bound, client
disconnects, /metrics and `bench serve`.

One server (a real subprocess on a tiny chat model) serves the whole module; the texts it must
produce come from LLM.generate / LLM.chat on the same model with the same engine settings.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minivllm import LLM, SamplingParams
from tests.server_procs import MINIVLLM, ServerProcess

API_KEY = "sk-test-key"
NAME = "tiny"
ENGINE_FLAGS = ["--max-model-len", "512", "--max-num-batched-tokens", "128"]
MAX_PENDING = 6
PROMPTS = ["Hello, my name is", "The capital of France is", "One two three"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def expected(tiny_chat_llama) -> dict:
    """What the server must answer, from LLM on the same model and engine settings."""
    with LLM(tiny_chat_llama, max_model_len=512, max_num_batched_tokens=128) as llm:
        greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        seeded = llm.generate(PROMPTS[0], SEEDED, use_tqdm=False)[0]
        logprobs = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3),
                                use_tqdm=False)[0]
        chat = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
        long_text = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].text
    return {"greedy": greedy, "seeded": seeded, "logprobs": logprobs, "chat": chat, "long_text": long_text}


@pytest.fixture(scope="module")
def server(tiny_chat_llama, expected):
    proc = ServerProcess(tiny_chat_llama, "--served-model-name", NAME, "--api-key", API_KEY,
                         "--max-pending-requests", str(MAX_PENDING), *ENGINE_FLAGS,
                         env={"MINIVLLM_LOG_LEVEL": "INFO"})  # (the heap-freeze line below is INFO)
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def http(server, method: str, path: str, body: dict | None = None, key: str | None = API_KEY,
         timeout: float = 30) -> tuple[int, dict | str]:
    """A raw HTTP call: (status, JSON body or text)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def scrape(server) -> dict[str, float]:
    """/metrics as {sample name{labels}: value}, parsed by prometheus_client's own parser."""
    status, text = http(server, "GET", "/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def wait_idle(server, timeout: float = 10.0) -> dict[str, float]:
    """Until the engine holds no request and no KV block."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(server)
        if (m["minivllm:num_requests_running{}"] == m["minivllm:num_requests_waiting{}"] == 0
                and m["minivllm:kv_cache_usage_perc{}"] == 0.0):
            return m
        assert time.monotonic() < deadline, f"the engine still holds requests: {m}"
        time.sleep(0.05)


def test_models_version_health_tokenize(server, client, tiny_chat_llama) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert http(server, "GET", "/version")[1]["version"]
    assert http(server, "GET", "/health", key=None)[0] == 200
    status, tokens = http(server, "POST", "/tokenize", {"prompt": PROMPTS[0]})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 512
    status, text = http(server, "POST", "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and PROMPTS[0] in text["prompt"]
    assert http(server, "POST", "/detokenize", {"tokens": [10**6]})[0] == 400
    # Up and serving, the server process has moved its start-up heap out of the collector's passes
    # (protocol/gc_heap.py), as the EngineCore and the worker have.
    for who in ("server", "EngineCore", "worker 0"):
        assert re.search(rf"{who}: \d+ objects moved out of the garbage collector's passes", server.output()), who


def test_completions_greedy_equal_llm_generate(client, expected) -> None:
    result = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert result.id.startswith("cmpl-") and result.object == "text_completion" and result.model == NAME
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == [o.outputs[0].text for o in expected["greedy"]]
    assert {c.finish_reason for c in result.choices} == {"length"}
    prompt_tokens = sum(len(o.prompt_token_ids) for o in expected["greedy"])
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (prompt_tokens, 36)
    assert result.usage.total_tokens == prompt_tokens + 36
    # The same prompts as token ids (one list, and a list of lists) give the same text.
    ids = [o.prompt_token_ids for o in expected["greedy"]]
    one = client.completions.create(model=NAME, prompt=ids[1], max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == expected["greedy"][1].outputs[0].text
    many = client.completions.create(model=NAME, prompt=ids[:2], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in many.choices] == [o.outputs[0].text for o in expected["greedy"][:2]]
    echoed = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPTS[0] + expected["greedy"][0].outputs[0].text


def test_streamed_completion_equals_the_whole_one(client, expected) -> None:
    stream = client.completions.create(model=NAME, prompt=PROMPTS[:2], max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, finish, chunks = {0: "", 1: ""}, {}, list(stream)
    assert len(chunks) > 3  # streamed, not one lump
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
        if chunk.choices[0].finish_reason:
            finish[chunk.choices[0].index] = chunk.choices[0].finish_reason
    assert texts == {i: expected["greedy"][i].outputs[0].text for i in (0, 1)}
    assert finish == {0: "length", 1: "length"}
    last = chunks[-1]  # the usage chunk: no choices
    assert last.choices == [] and last.usage.completion_tokens == 24


def test_n_and_seed(client, expected) -> None:
    kwargs = dict(model=NAME, prompt=PROMPTS[0], n=3, temperature=1.0, seed=7, max_tokens=10,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in expected["seeded"].outputs]  # seeded: what LLM.generate made
    assert len(set(texts)) > 1  # three different samples
    # Streamed, each chunk says which choice it belongs to.
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert list(streamed.values()) == texts


def test_completion_logprobs(client, expected) -> None:
    result = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
    reference = expected["logprobs"].outputs[0]
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    want = [position[token].logprob for token, position in zip(reference.token_ids, reference.logprobs)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-5)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert result.choices[0].text == reference.text
    assert lp.tokens == [reference.logprobs[i][t].decoded_token for i, t in enumerate(reference.token_ids)]


def test_chat_equals_llm_chat(client, expected) -> None:
    want = expected["chat"].outputs[0].text
    result = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    message = result.choices[0].message
    assert message.role == "assistant" and message.content == want
    assert result.usage.prompt_tokens == len(expected["chat"].prompt_token_ids)
    assert result.usage.completion_tokens == 12
    # List-of-text-parts content renders as the same conversation.
    parts = [CHAT[0], {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    same = client.chat.completions.create(model=NAME, messages=parts, max_completion_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert same.choices[0].message.content == want
    # Streamed: the role first, then the text, then the usage chunk.
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_logprobs_and_template_options(server, client) -> None:
    result = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                            top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.logprob - 1e-6 or \
            entry.logprob <= entry.top_logprobs[0].logprob
    # add_generation_prompt=False and a request-level template change the prompt.
    status, plain = http(server, "POST", "/tokenize", {"messages": CHAT})
    status2, no_gen = http(server, "POST", "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    status3, custom = http(server, "POST", "/tokenize", {
        "messages": CHAT, "chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ flag }}",
        "chat_template_kwargs": {"flag": "!"}})
    assert status == status2 == status3 == 200
    assert no_gen["count"] < plain["count"] and custom["tokens"] != plain["tokens"]
    status, detok = http(server, "POST", "/detokenize", {"tokens": custom["tokens"]})
    assert detok["prompt"].endswith("[Be brief.][Hi there]!")


def test_stop_strings_and_stop_reason(client, expected) -> None:
    text = expected["long_text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip()
    result = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=40, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True})
    choice = result.choices[0]
    assert choice.text == text[: text.index(stop)] and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    kept = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=40, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n must be"),
    (dict(logprobs=21), "logprobs"),
    (dict(prompt=""), "empty"),
    (dict(prompt="word " * 600), "max_model_len"),
    (dict(prompt=[[1, 2], [10**6]]), "vocabulary"),
    (dict(extra_body={"min_tokens": 5, "max_tokens": 2}), "min_tokens"),
    (dict(extra_body={"priority": 3}), "priority"),
    (dict(extra_body={"top_k": "many"}), "top_k"),
])
def test_bad_input_is_a_400_and_the_server_goes_on(client, expected, kwargs, words) -> None:
    request = {**dict(model=NAME, prompt=PROMPTS[0], max_tokens=4), **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**request)
    assert info.value.status_code == 400
    error = info.value.body
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == 400
    assert words in error["message"], error["message"]
    ok = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert ok.choices[0].text == expected["greedy"][0].outputs[0].text


def test_chat_errors_and_unknown_model(server, client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert info.value.body["param"] == "model" and "gpt-4" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=NAME, messages=CHAT, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    status, body = http(server, "POST", "/v1/chat/completions", {"model": NAME})  # no messages
    assert status == 400 and "messages" in body["error"]["message"]
    request = urllib.request.Request(server.url + "/v1/completions", data=b"{not json", method="POST",
                                     headers={"Authorization": f"Bearer {API_KEY}",
                                              "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request, timeout=10)
    assert raw.value.code == 400 and json.loads(raw.value.read())["error"]["type"] == "BadRequestError"


def test_api_key_is_enforced(server) -> None:
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 2}
    for key in (None, "wrong"):
        status, answer = http(server, "POST", "/v1/completions", body, key=key)
        assert status == 401 and answer["error"]["type"] == "AuthenticationError"
        assert http(server, "GET", "/v1/models", key=key)[0] == 401
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert http(server, "POST", "/v1/completions", body)[0] == 200
    assert http(server, "GET", "/health", key=None)[0] == 200 and http(server, "GET", "/metrics", key=None)[0] == 200


def test_metrics_parse_and_counters_move(server, client) -> None:
    before = wait_idle(server)
    client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    after = wait_idle(server)
    assert after["minivllm:generation_tokens_total{}"] - before["minivllm:generation_tokens_total{}"] == 7
    assert after["minivllm:prompt_tokens_total{}"] > before["minivllm:prompt_tokens_total{}"]
    key = "minivllm:request_success_total{finished_reason=length}"
    assert after[key] - before.get(key, 0) == 1
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
                      "request_generation_tokens"):
        assert after[f"minivllm:{histogram}_count{{}}"] == before[f"minivllm:{histogram}_count{{}}"] + 1
    assert after["minivllm:inter_token_latency_seconds_count{}"] > before["minivllm:inter_token_latency_seconds_count{}"]
    assert after["minivllm:prefix_cache_queries_total{}"] > before["minivllm:prefix_cache_queries_total{}"]
    assert "minivllm:prefix_cache_hits_total{}" in after and "minivllm:num_preemptions_total{}" in after


LONG = {"model": NAME, "prompt": "Tell me a long story", "max_tokens": 480, "temperature": 0, "ignore_eos": True}


async def _open_stream(server, body: dict, chunks: int):
    """Send a streaming request, read `chunks` events, return the (reader, writer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    payload = json.dumps(body).encode()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    seen = 0
    while seen < chunks:
        line = await asyncio.wait_for(reader.readline(), 30)
        assert line, "the server closed the stream early"
        seen += line.startswith(b"data: ")
    return reader, writer


def test_disconnect_aborts_and_frees_kv(server) -> None:
    before = wait_idle(server)
    abort = "minivllm:request_success_total{finished_reason=abort}"

    async def streaming_client_leaves() -> None:
        _, writer = await _open_stream(server, {**LONG, "stream": True}, chunks=3)
        writer.close()  # gone mid-stream

    async def waiting_client_leaves() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        payload = json.dumps(LONG).encode()
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        await writer.drain()
        deadline = time.monotonic() + 10
        while scrape(server)["minivllm:num_requests_running{}"] == 0:  # until it runs in the engine
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        writer.close()  # gone before the (non-streamed) answer

    for leave in (streaming_client_leaves, waiting_client_leaves):
        asyncio.run(leave())
        after = wait_idle(server)  # KV usage back to 0 long before 480 tokens could be made
        assert after.get(abort, 0) == before.get(abort, 0) + 1
        assert after["minivllm:generation_tokens_total{}"] - before["minivllm:generation_tokens_total{}"] < 480
        before = after


def test_in_flight_bound_refuses_at_once(server, client) -> None:
    async def main() -> None:
        streams = [await _open_stream(server, {**LONG, "stream": True}, chunks=1) for _ in range(MAX_PENDING)]
        try:
            start = time.monotonic()
            with pytest.raises(openai.RateLimitError) as info:
                client.completions.create(model=NAME, prompt="Hi", max_tokens=2)
            assert time.monotonic() - start < 5 and str(MAX_PENDING) in info.value.body["message"]
        finally:
            for _, writer in streams:
                writer.close()
        # n counts: one request asking for more completions than the bound allows is refused too.
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=NAME, prompt="Hi", max_tokens=2, n=MAX_PENDING + 1)

    asyncio.run(main())
    wait_idle(server)
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=2).choices[0].finish_reason


def test_bench_serve_runs_against_the_server(server, tmp_path) -> None:
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    result = subprocess.run(
        [*MINIVLLM, "bench", "serve", "--base-url", server.url, "--num-prompts", "6", "--input-len", "8:24",
         "--output-len", "8", "--request-rate", "20,inf", "--max-concurrency", "4", "--goodput", "ttft:5000",
         "tpot:1000", "--json", str(out), "--plot", str(plot)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OPENAI_API_KEY": API_KEY})
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["model"] == NAME  # taken from /v1/models
    assert [r["request_rate"] for r in report["results"]] == [20.0, "inf"]
    for r in report["results"]:
        assert r["completed"] == 6 and r["failed"] == 0 and r["total_output_tokens"] == 48
        assert r["output_throughput"] > 0 and r["request_throughput"] > 0
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] and r["tpot_ms"]["mean"] > 0
        assert r["itl_ms"]["mean"] > 0 and r["e2e_ms"]["p99"] >= r["ttft_ms"]["p99"]
        assert r["goodput"] == pytest.approx(r["request_throughput"])  # generous SLOs: every request meets them
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert "Output token throughput" in result.stdout
