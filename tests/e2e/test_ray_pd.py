"""Prefill/decode instances started and discovered through Ray, on a real local Ray cluster of two
simulated nodes: `minivllm proxy --ray-prefill-instances 1 --ray-decode-instances 1` starts both
as actors (one CPU each, so one per node), routes 1P1D over them token-identically to an instance
answering alone; a second proxy finds the same instances by namespace; when the launching proxy
exits, its actors and their servers are gone."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import openai
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from tests.pd_procs import ProxyProcess  # noqa: E402

SERVE_ARGS = "--device cpu --dtype float32 --num-gpu-blocks 96 --max-model-len 256 --block-size 8"
PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "One, two, three, four, five, six"]
NAMESPACE = "minivllm-pd-test"


def answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/health", timeout=2).close()
        return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_pd_instances_started_and_discovered_through_ray(ray_cluster, tiny_llama: str) -> None:
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.address}
    launcher = ProxyProcess([], [], "--ray-prefill-instances", "1", "--ray-decode-instances", "1", "--model",
                            tiny_llama, "--serve-args", SERVE_ARGS, "--ray-namespace", NAMESPACE, timeout=240, env=env)
    second = None
    try:
        infos = {name: ray.get(ray.get_actor(name, namespace=NAMESPACE).info.remote())
                 for name in ("prefill-0", "decode-0")}
        assert all(info["alive"] for info in infos.values())
        with urllib.request.urlopen(launcher.url + "/health", timeout=30) as response:
            health = json.loads(response.read())
        assert infos["decode-0"]["url"] in json.dumps(health) and infos["prefill-0"]["url"] in json.dumps(health)

        # 1P1D through the proxy equals the decode instance answering alone (it serves plain requests too)
        direct, routed = client(infos["decode-0"]["url"]), client(launcher.url)
        model = direct.models.list().data[0].id
        for prompt in PROMPTS:
            kwargs = dict(model=model, prompt=prompt, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True})
            assert routed.completions.create(**kwargs).choices[0].text == direct.completions.create(**kwargs).choices[0].text

        # discovery: a second proxy given only the namespace routes over the same instances
        second = ProxyProcess([], [], "--ray-namespace", NAMESPACE, timeout=60, env=env)
        kwargs = dict(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
        assert (client(second.url).completions.create(**kwargs).choices[0].text
                == direct.completions.create(**kwargs).choices[0].text)
        second.stop()
        second = None
    finally:
        if second is not None:
            second.stop()
        assert launcher.stop() == 0, launcher.output()[-3000:]
    # the launching proxy is gone: so are its actors and their servers
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = [n for n in ray.util.list_named_actors(all_namespaces=True) if n["namespace"] == NAMESPACE]
        if not left and not any(answers(info["url"]) for info in infos.values()):
            break
        time.sleep(0.5)
    assert not left, left
    assert not any(answers(info["url"]) for info in infos.values())


def test_bad_ray_proxy_flags_are_refused_clearly(tiny_llama: str) -> None:
    import argparse

    from minivllm.frontend.proxy import run_proxy

    def args(**kw) -> argparse.Namespace:
        base = dict(prefill=[], decode=[], request_timeout=600.0, connect_timeout=5.0, ray_prefill_instances=0,
                    ray_decode_instances=0, model=None, serve_args="", ray_namespace=None, ray_startup_timeout=600.0)
        return argparse.Namespace(**{**base, **kw})

    with pytest.raises(ValueError, match="give the decode instances"):
        run_proxy(args())
    with pytest.raises(ValueError, match="two ways to name the instances"):
        run_proxy(args(decode=["http://127.0.0.1:1"], ray_decode_instances=1, model=tiny_llama))
    with pytest.raises(ValueError, match="--ray-decode-instances must be >= 1"):
        run_proxy(args(ray_prefill_instances=1, model=tiny_llama))
    with pytest.raises(ValueError, match="--model must be a local model directory"):
        run_proxy(args(ray_decode_instances=1, model="/nonexistent"))
    with pytest.raises(ValueError, match="must not set --port"):
        run_proxy(args(ray_decode_instances=1, model=tiny_llama, serve_args="--port 9"))
