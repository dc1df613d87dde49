"""`minivllm proxy` over real `minivllm serve` instances: health, model listing, and clear errors
(never a hang) when an instance is down or is not a KV producer. (The full prefill -> decode path
is in test_pd_disagg.py.)"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.pd_procs import ProxyProcess
from tests.server_procs import ServerProcess, free_port


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def plain_server(tiny_llama: str):
    server = ServerProcess(tiny_llama, "--device", "cpu", "--num-gpu-blocks", "64", "--max-model-len", "256")
    yield server
    assert server.stop() == 0


def test_health_names_the_backends_that_are_down(plain_server: ServerProcess) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = ProxyProcess([plain_server.url, dead], [plain_server.url])
    try:
        status, body = get(proxy.url + "/health")
        assert status == 503
        assert dead in body["error"]["message"] and plain_server.url not in body["error"]["message"]
        assert body["backends"]["prefill"][plain_server.url] == "ok"
        assert body["backends"]["decode"] == {plain_server.url: "ok"}
        # /v1/models is a decode instance's
        status, models = get(proxy.url + "/v1/models")
        assert status == 200 and models["data"][0]["id"]
    finally:
        assert proxy.stop() == 0

    proxy = ProxyProcess([plain_server.url], [plain_server.url])
    try:
        status, body = get(proxy.url + "/health")
        assert status == 200 and body["status"] == "ok"
    finally:
        proxy.stop()


def test_a_request_no_prefill_instance_can_serve_gets_a_clear_error(plain_server: ServerProcess) -> None:
    """One prefill instance refuses connections, the other is no KV producer: the client hears
    both, as an OpenAI error, at once."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = ProxyProcess([dead, plain_server.url], [plain_server.url])
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=60)
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=plain_server_model(client), prompt="Hello", max_tokens=4)
        assert time.monotonic() - start < 30
        assert info.value.status_code == 503, info.value.response.text
        message = info.value.response.json()["error"]["message"]
        assert "no prefill instance could serve this request" in message
        assert dead in message and "--kv-transfer-role producer" in message
        # A request the instance itself refuses (bad input) comes back as its 400, not retried.
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model=plain_server_model(client), prompt="Hello", temperature=-1.0)
    finally:
        proxy.stop()


def plain_server_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_without_prefill_instances_the_proxy_balances_ordinary_ones(plain_server: ServerProcess) -> None:
    """Colocated mode (the baseline `bench compare` puts behind the same proxy): the answer is the
    instance's own, streamed or not."""
    proxy = ProxyProcess([], [plain_server.url])
    try:
        direct = openai.OpenAI(base_url=plain_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        routed = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=60)
        model = plain_server_model(direct)
        kwargs = dict(model=model, prompt="The quick brown fox", max_tokens=12, temperature=0.0,
                      extra_body={"ignore_eos": True})
        expected = direct.completions.create(**kwargs).choices[0].text
        assert routed.completions.create(**kwargs).choices[0].text == expected
        chunks = routed.completions.create(**kwargs, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        status, body = get(proxy.url + "/health")
        assert status == 200 and "prefill" not in body
    finally:
        assert proxy.stop() == 0
