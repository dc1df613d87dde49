"""Prefill/decode disaggregation with tensor parallelism on CPU (gloo, tiny model, two workers per
instance): each consumer rank pulls its own shard of the KV heads from the producer's same rank,
and a request runs only once every rank's shard has arrived. Greedy output equals the producer
generating alone."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from tests.server_procs import free_port

PROMPTS = [[(7 * i + j) % 300 + 1 for j in range(n)] for i, n in enumerate([9, 23, 41])]
COMMON = dict(tensor_parallel_size=2, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              num_gpu_blocks=64, block_size=8)


@pytest.mark.parametrize("connector", ["P2pNcclConnector", pytest.param("ZmqTcpConnector", marks=pytest.mark.slow)])
def test_1p1d_with_two_ranks_each_is_token_identical(tiny_llama: str, connector: str) -> None:
    producer_config = {"kv_connector": connector, "kv_role": "kv_producer", "kv_port": free_port()}
    consumer_config = {"kv_connector": connector, "kv_role": "kv_consumer"}
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(tiny_llama, kv_transfer_config=producer_config, **COMMON) as producer, \
            LLM(tiny_llama, kv_transfer_config=consumer_config, enable_prefix_caching=False, **COMMON) as consumer:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        expected = [o.outputs[0].token_ids for o in producer.generate(prompts, greedy, use_tqdm=False)]
        prefill = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        # (fresh prompts for the producer would hit its prefix cache: that is fine, it still holds them)
        params = [o.kv_transfer_params for o in producer.generate(prompts, prefill, use_tqdm=False)]
        assert all(p["tp_size"] == 2 and p["remote_block_ids"] for p in params)
        decode = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, extra_args={"kv_transfer_params": p})
                  for p in params]
        got = [o.outputs[0].token_ids for o in consumer.generate(prompts, decode, use_tqdm=False)]
        assert got == expected
        assert consumer.get_stats().num_running_reqs == 0
