"""Prefill/decode disaggregation end to end on CPU (fp32, tiny model): two real `minivllm serve`
instances (KV producer and consumer; ZMQ/TCP transport, and the P2pNcclConnector's
point-to-point one over gloo) behind the real `minivllm proxy`, spoken
to with the real openai client. Greedy output is token-identical to one colocated instance; a
producer killed before the pull fails the request clearly (never a hang) and frees the consumer's
blocks; /health names the dead instance."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.pd_procs import ProxyProcess
from tests.server_procs import ServerProcess, children_of, free_port

COMMON = ("--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", "96", "--max-model-len", "256",
          "--block-size", "8")
PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "Paris is the capital of",
           "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve"]


# ZMQ/TCP raw frames, and device-to-device point-to-point (NCCL on GPUs; gloo here on CPU).
CONNECTORS = ["ZmqTcpConnector", "P2pNcclConnector"]


def producer_args(port: int, hold_timeout_s: float = 60.0, connector: str = "ZmqTcpConnector") -> tuple[str, ...]:
    config = {"kv_connector": connector, "kv_role": "kv_producer", "kv_port": port,
              "kv_connector_extra_config": {"hold_timeout_s": hold_timeout_s}}
    return (*COMMON, "--kv-transfer-config", json.dumps(config))


def consumer_args(pull_timeout_s: float = 3.0, connector: str = "ZmqTcpConnector") -> tuple[str, ...]:
    config = {"kv_connector": connector, "kv_role": "kv_consumer",
              "kv_connector_extra_config": {"pull_timeout_s": pull_timeout_s}}
    return (*COMMON, "--kv-transfer-config", json.dumps(config))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def stats(url: str) -> dict[str, float]:
    """The instance's KV cache usage and running/waiting requests, from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
            if line.startswith((f"minivllm:{name}{{", f"minivllm:{name} ")):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


@pytest.fixture(scope="module")
def colocated(tiny_llama: str):
    server = ServerProcess(tiny_llama, *COMMON)
    yield server
    server.stop()


@pytest.fixture(scope="module", params=CONNECTORS)
def pd(tiny_llama: str, request):
    producer = ServerProcess(tiny_llama, *producer_args(free_port(), connector=request.param))
    consumer = ServerProcess(tiny_llama, *consumer_args(connector=request.param))
    proxy = ProxyProcess([producer.url], [consumer.url])
    yield producer, consumer, proxy
    proxy.stop()
    consumer.stop()
    producer.stop()


def test_1p1d_output_is_token_identical_to_a_colocated_instance(colocated: ServerProcess, pd) -> None:
    producer, consumer, proxy = pd
    direct, routed = client(colocated.url), client(proxy.url)
    model = direct.models.list().data[0].id
    for prompt in PROMPTS:
        kwargs = dict(model=model, prompt=prompt, max_tokens=24, temperature=0.0, logprobs=0,
                      extra_body={"ignore_eos": True})
        expected = direct.completions.create(**kwargs).choices[0]
        got = routed.completions.create(**kwargs).choices[0]
        assert got.text == expected.text
        assert got.logprobs.tokens == expected.logprobs.tokens
        streamed = routed.completions.create(**kwargs, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
        # without logprobs the decode instance starts from the token the prefill sampled
        plain = {key: value for key, value in kwargs.items() if key != "logprobs"}
        assert routed.completions.create(**plain).choices[0].text == expected.text
    # seeded sampling too (the decode instance samples every output token)
    sampled = dict(model=model, prompt=PROMPTS[1], max_tokens=10, temperature=0.8, seed=7,
                   extra_body={"ignore_eos": True})
    assert (routed.completions.create(**sampled).choices[0].text
            == direct.completions.create(**sampled).choices[0].text)
    # everything pulled: the producer holds no blocks any more, the consumer none once finished
    deadline = time.monotonic() + 10
    while stats(producer.url).get("kv_cache_usage_perc", 1.0) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats(producer.url)["kv_cache_usage_perc"] == 0
    assert stats(consumer.url)["kv_cache_usage_perc"] == 0


def test_a_prefill_answer_carries_kv_transfer_params(pd) -> None:
    producer, _, _ = pd
    body = {"prompt": PROMPTS[0], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    request = urllib.request.Request(producer.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    assert params["remote_host"] == "127.0.0.1" and isinstance(params["remote_port"], int)
    assert isinstance(params["first_output_token_id"], int)  # the token its prefill sampled


@pytest.mark.parametrize("connector", ["P2pNcclConnector", pytest.param("ZmqTcpConnector", marks=pytest.mark.slow)])
def test_a_killed_producer_fails_the_request_clearly_and_frees_the_blocks(tiny_llama: str, connector: str) -> None:
    """The prefill instance dies after prefilling, before the decode instance pulls: the client gets
    a clear error within the pull timeout (the proxy has no other prefill instance to retry on),
    the consumer frees the blocks it reserved, and /health says which instance is down. (The two
    transports share this control path; CI runs one.)"""
    producer = ServerProcess(tiny_llama, *producer_args(free_port(), connector=connector))
    consumer = ServerProcess(tiny_llama, *consumer_args(pull_timeout_s=2.0, connector=connector))
    proxy = ProxyProcess([producer.url], [consumer.url])
    try:
        body = {"prompt": PROMPTS[2], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        request = urllib.request.Request(producer.url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        params = json.loads(urllib.request.urlopen(request, timeout=60).read())["kv_transfer_params"]
        for pid in [*children_of(producer.proc.pid), producer.proc.pid]:
            os.kill(pid, signal.SIGKILL)
        producer.proc.wait()
        model = client(consumer.url).models.list().data[0].id
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            client(consumer.url).completions.create(model=model, prompt=PROMPTS[2], max_tokens=8,
                                                    extra_body={"kv_transfer_params": params})
        assert time.monotonic() - start < 30
        assert info.value.status_code >= 500 and "KV" in info.value.response.text
        assert stats(consumer.url)["kv_cache_usage_perc"] == 0  # the reserved blocks were freed
        # Through the proxy: the producer is down, no other to retry on: a clear 503 at once.
        with pytest.raises(openai.APIStatusError) as info:
            client(proxy.url).completions.create(model=model, prompt=PROMPTS[2], max_tokens=8)
        assert info.value.status_code == 503 and producer.url in info.value.response.text
        try:
            urllib.request.urlopen(proxy.url + "/health", timeout=30)
            raise AssertionError("/health said ok with the producer dead")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and producer.url in e.read().decode()
        # the consumer itself keeps serving ordinary requests
        assert client(consumer.url).completions.create(model=model, prompt="Hello", max_tokens=4).choices[0].text
    finally:
        proxy.stop()
        consumer.stop()
        producer.stop()
