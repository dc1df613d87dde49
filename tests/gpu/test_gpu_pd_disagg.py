"""1P1D on two GPUs in bf16: a prefill instance on GPU 0 and a decode instance on GPU 1 (the
P2pNcclConnector, which --kv-transfer-role picks on CUDA), behind the real proxy, spoken to with
the real openai client. Greedy output equals a colocated instance's, token for token."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.pd_procs import ProxyProcess
from tests.server_procs import ServerProcess, free_port

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

COMMON = ("--device", "cuda", "--max-model-len", "512", "--max-num-seqs", "16", "--gpu-memory-utilization", "0.3")
PROMPTS = [list(range(1, 40)), [(7 * j) % 400 + 3 for j in range(200)], [5, 9, 13]]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_1p1d_on_two_gpus_equals_a_colocated_instance(tiny_model_factory, dtype: str) -> None:
    model_dir = tiny_model_factory("qwen3")
    common = (*COMMON, "--dtype", dtype)
    colocated = ServerProcess(model_dir, *common, env={"CUDA_VISIBLE_DEVICES": "1"}, timeout=300)
    producer = ServerProcess(model_dir, *common, "--kv-transfer-role", "producer", "--kv-port", str(free_port()),
                             env={"CUDA_VISIBLE_DEVICES": "0"}, timeout=300)
    consumer = ServerProcess(model_dir, *common, "--kv-transfer-role", "consumer",
                             env={"CUDA_VISIBLE_DEVICES": "1"}, timeout=300)
    proxy = ProxyProcess([producer.url], [consumer.url])
    try:
        direct, routed = client(colocated.url), client(proxy.url)
        model = direct.models.list().data[0].id
        for prompt in PROMPTS:
            kwargs = dict(model=model, prompt=prompt, max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True})
            expected = direct.completions.create(**kwargs).choices[0].text
            assert routed.completions.create(**kwargs).choices[0].text == expected
    finally:
        proxy.stop()
        consumer.stop()
        producer.stop()
        colocated.stop()
