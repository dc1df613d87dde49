"""protocol/: messages survive the wire; bad settings are ValueErrors naming the allowed range."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest

from minivllm.protocol.config import EngineConfig, default_max_num_batched_tokens
from minivllm.protocol.messages import (
    AbortRequests,
    AddRequests,
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    Shutdown,
    UtilityCall,
    WorkerCall,
    WorkerReply,
    pack_token_ids,
    unpack_token_ids,
)
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams
from minivllm.protocol.serial import (
    encode,
    engine_input_decoder,
    engine_output_decoder,
    worker_input_decoder,
    worker_output_decoder,
)


def test_protocol_imports_no_torch() -> None:
    code = "import minivllm.protocol.messages, minivllm.protocol.serial, minivllm.protocol.config, minivllm.protocol.ipc, sys; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_core_imports_no_torch() -> None:
    code = "import minivllm.core.engine_core, sys; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.parametrize(
    "message, decoder",
    [
        (EngineCoreRequest(request_id="a", prompt_token_ids=[1, 2], sampling_params=SamplingParams(seed=3),
                           arrival_time=1.5, eos_token_ids=[0]), engine_input_decoder),
        (EngineCoreRequest(request_id="a", prompt_token_ids=[1], sampling_params=SamplingParams(),
                           arrival_time=1.5, priority=-3, cache_salt="s"), engine_input_decoder),
        (EngineCoreRequest(request_id="a", prompt_token_ids=[1], arrival_time=1.5,
                           sampling_params=SamplingParams(output_kind=RequestOutputKind.DELTA)), engine_input_decoder),
        (AddRequests([EngineCoreRequest(request_id=i, prompt_token_ids=[1], sampling_params=SamplingParams(),
                                        arrival_time=1.5) for i in "ab"]), engine_input_decoder),
        (AbortRequests(["a", "b"]), engine_input_decoder),
        (UtilityCall(7, "get_engine_info"), engine_input_decoder),
        (Shutdown(), engine_input_decoder),
        (EngineCoreOutputs(outputs=[EngineCoreOutput("a", [5], "stop", 5)]), engine_output_decoder),
        (EngineCoreOutputs(outputs=[EngineCoreOutput("a", [5], num_cached_tokens=32)]), engine_output_decoder),
        (SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(req_id="a", prompt_token_ids=[1], output_token_ids=[],
                                               sampling_params=SamplingParams(), block_ids=[3],
                                               num_computed_tokens=0)],
            scheduled_cached_reqs=[CachedRequestData("b", [4], 17)],
            num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2, finished_req_ids=["c"],
        ), worker_input_decoder),
        (WorkerCall("initialize_cache", [10]), worker_input_decoder),
        (ModelRunnerOutput(["a"], [9]), worker_output_decoder),
        (WorkerReply(0, "ready", 1234), worker_output_decoder),
    ],
)
def test_messages_round_trip(message, decoder) -> None:
    assert decoder.decode(encode(message)) == message


def test_new_requests_carry_their_prompt_packed() -> None:
    ids = [0, 1, 151_935, 2**31 - 1, 7] * 1000
    new = NewRequestData(req_id="a", prompt_token_ids=ids, output_token_ids=[9], sampling_params=SamplingParams(),
                         block_ids=[3], num_computed_tokens=0)
    assert isinstance(new.prompt_token_ids, bytes) and new.num_prompt_tokens == len(ids)
    assert new.prompt_token_ids == pack_token_ids(ids) and unpack_token_ids(new.prompt_token_ids) == ids
    wire = encode(SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=[], num_scheduled_tokens={"a": 1},
                                  total_num_scheduled_tokens=1, finished_req_ids=[]))
    assert pack_token_ids(ids) in wire  # one bin, not an array of ints of up to 5 bytes each
    received = worker_input_decoder.decode(wire).scheduled_new_reqs[0]
    assert np.array_equal(np.frombuffer(received.prompt_token_ids, dtype="<i4"), ids)


def test_malformed_message_is_rejected_by_the_decoder() -> None:
    with pytest.raises(msgspec.ValidationError):
        engine_input_decoder.decode(msgspec.msgpack.encode({"type": "add", "request_id": 1}))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(seed=-1), "seed must be in"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
        (dict(output_kind=3), "output_kind must be a RequestOutputKind"),
        (dict(output_kind="delta"), "output_kind must be a RequestOutputKind"),
    ],
)
def test_sampling_params_validation(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.ignore_eos, p.seed) == (1.0, 1.0, 0, 16, False, None)
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    # vLLM's values; plain ints are taken too.
    assert [k.value for k in RequestOutputKind] == [0, 1, 2] and [k.name for k in RequestOutputKind] == [
        "CUMULATIVE", "DELTA", "FINAL_ONLY"]
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY


def test_engine_config_reads_the_model(tiny_llama) -> None:
    config = EngineConfig.create(tiny_llama)
    assert (config.max_model_len, config.vocab_size, config.eos_token_ids) == (512, 512, [0])
    assert msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig) == config


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_model_len=100000), r"exceeds the model's maximum length \(512\); use a value in \[1, 512\]"),
        (dict(block_size=0), "block_size must be an integer >= 1"),
        (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1"),
        (dict(num_gpu_blocks=0), "num_gpu_blocks must be an integer >= 1"),
        (dict(dtype="float8"), "dtype must be one of"),
        (dict(device="tpu"), "device must be one of"),
        (dict(load_format="pt"), "load_format must be one of"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
        (dict(tensor_parallel_size=3), r"tensor_parallel_size=3 does not split this model \(4 attention heads, "
                                       r"2 KV heads, intermediate_size 128\); use one of 1, 2, 4"),
        (dict(scheduling_policy="lifo"), "scheduling_policy must be one of fcfs, priority, v0"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold must be an integer >= 0"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be True or False"),
        (dict(scheduling_policy="v0", long_prefill_token_threshold=8), "v0' schedules whole prompts"),
        (dict(scheduling_policy="v0", max_num_batched_tokens=100), r"must be >= max_model_len \(512\)"),
        (dict(usage_context="LLM"), "usage_context must be one of LLM_CLASS, OPENAI_API_SERVER, ENGINE_CONTEXT"),
    ],
)
def test_engine_config_validation(tiny_llama, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(tiny_llama, **kwargs)


def test_engine_config_scheduler_defaults(tiny_llama, tiny_model_factory) -> None:
    config = EngineConfig.create(tiny_llama)
    assert (config.enable_prefix_caching, config.scheduling_policy, config.long_prefill_token_threshold) == (
        True, "fcfs", 0)
    assert config.max_num_batched_tokens == 2048
    # v0 prefills whole prompts: its default budget holds the longest.
    assert EngineConfig.create(tiny_llama, scheduling_policy="v0").max_num_batched_tokens == 2048
    long_model = tiny_model_factory("llama", max_position_embeddings=4096)
    assert EngineConfig.create(long_model, scheduling_policy="v0").max_num_batched_tokens == 4096
    assert EngineConfig.create(long_model).max_num_batched_tokens == 2048
    assert EngineConfig.create(tiny_llama, scheduling_policy="v0", max_num_batched_tokens=512).max_num_batched_tokens == 512


GIB = 2**30


@pytest.mark.parametrize(
    "on_cuda, usage_context, gpu, budget",
    [
        (False, "LLM_CLASS", None, 2048),
        (True, "LLM_CLASS", (80 * GIB, "NVIDIA H100 80GB HBM3"), 16384),  # vLLM's, for H100 / H200 / MI300X
        (True, "LLM_CLASS", (141 * GIB, "NVIDIA H200"), 16384),
        (True, "LLM_CLASS", (80 * GIB, "NVIDIA A100-SXM4-80GB"), 8192),  # not on an A100 (vLLM PR 17885)
        (True, "LLM_CLASS", (48 * GIB, "NVIDIA L40S"), 8192),
        (True, "LLM_CLASS", None, 8192),  # the GPU unknown: the smaller
        (True, "OPENAI_API_SERVER", (80 * GIB, "NVIDIA H100 80GB HBM3"), 8192),
        (True, "ENGINE_CONTEXT", (80 * GIB, "NVIDIA H100 80GB HBM3"), 8192),
    ],
)
def test_default_step_budget_follows_vllm(on_cuda, usage_context, gpu, budget) -> None:
    assert default_max_num_batched_tokens(on_cuda, usage_context, gpu) == budget


def test_engine_config_needs_a_model_dir(tmp_path) -> None:
    with pytest.raises(ValueError, match="model must be a directory"):
        EngineConfig.create(str(tmp_path / "nope"))


def test_a_batch_over_the_engines_message_limit_goes_in_whole_halves() -> None:
    """EngineCoreClient._send_batch: each message under the limit, every request once, in order."""
    from minivllm.frontend.core_client import EngineCoreClient

    requests = [EngineCoreRequest(request_id=str(i), prompt_token_ids=list(range(1, 200)), arrival_time=0.0,
                                  sampling_params=SamplingParams()) for i in range(13)]
    limit = len(encode(AddRequests(requests[:4]))) + 1
    sent: list[bytes] = []
    client = EngineCoreClient.__new__(EngineCoreClient)  # (no engine: only the splitting runs)
    client._send = sent.append
    client._send_batch(requests, limit)
    assert len(sent) > 1 and all(len(payload) <= limit for payload in sent)
    received = [r.request_id for payload in sent for r in engine_input_decoder.decode(payload).requests]
    assert received == [r.request_id for r in requests]
