"""kv_transfer_params through the frontend, vLLM's way: SamplingParams.extra_args["kv_transfer_params"]
-> EngineCoreRequest.kv_transfer_params; a finished EngineCoreOutput's -> RequestOutput's."""

from __future__ import annotations

import msgspec
import pytest

from minivllm.frontend.input_processor import InputProcessor
from minivllm.frontend.output_processor import OutputProcessor, RequestState
from minivllm.protocol.messages import EngineCoreOutput, EngineCoreRequest, EngineInfo
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams

INFO = EngineInfo(model="m", tokenizer="t", max_model_len=64, vocab_size=512, eos_token_ids=[0], block_size=16,
                  num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, engine_pid=0, worker_pids=[])
PROMPT = {"prompt_token_ids": [5, 6, 7]}


def test_extra_args_kv_transfer_params_reach_the_engine_request_once() -> None:
    params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}, "x": 1})
    request, _ = InputProcessor(INFO, None).process("r", PROMPT, params)
    assert request.kv_transfer_params == {"do_remote_decode": True}
    assert request.sampling_params.extra_args == {"x": 1}  # not sent twice
    assert params.extra_args["kv_transfer_params"] == {"do_remote_decode": True}  # the user's object unchanged
    # and it survives the wire
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert wire.kv_transfer_params == {"do_remote_decode": True}


def test_without_kv_transfer_params_the_request_carries_none() -> None:
    request, _ = InputProcessor(INFO, None).process("r", PROMPT, SamplingParams(extra_args={"x": 1}))
    assert request.kv_transfer_params is None and request.sampling_params.extra_args == {"x": 1}


def test_bad_kv_transfer_params_are_refused_clearly() -> None:
    processor = InputProcessor(INFO, None)
    with pytest.raises(ValueError, match="kv_transfer_params must be a JSON object"):
        processor.process("r", PROMPT, SamplingParams(extra_args={"kv_transfer_params": [1, 2]}))
    with pytest.raises(ValueError, match="kv_transfer_params needs n=1"):
        processor.process("r", PROMPT, SamplingParams(n=2, extra_args={"kv_transfer_params": {}}))
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=[1])


def test_finished_outputs_carry_the_connectors_kv_transfer_params() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"}
    processor = OutputProcessor(None)
    processor.add_request("r", None, [5, 6, 7], params=SamplingParams(max_tokens=2))
    finished, _ = processor.process_outputs([EngineCoreOutput("r", [9])])
    assert finished == []
    finished, _ = processor.process_outputs([EngineCoreOutput("r", [9], finish_reason="length",
                                                              kv_transfer_params=params)])
    assert finished[0].kv_transfer_params == params
    # the streaming path (AsyncLLM) too
    state = RequestState("s", None, [5], None, params=SamplingParams(max_tokens=1))
    state.update(EngineCoreOutput("s", [9], finish_reason="length", kv_transfer_params=params))
    assert state.to_stream_output(RequestOutputKind.DELTA).kv_transfer_params == params


def test_kv_transfer_role_is_sugar_for_kv_transfer_config() -> None:
    from minivllm.frontend.cli import build_parser
    from minivllm.frontend.server.args import resolve_kv_transfer_config

    def resolve(*argv: str):
        return resolve_kv_transfer_config(build_parser().parse_args(["serve", "--model", "m", *argv]))

    assert resolve() is None
    assert resolve("--kv-transfer-role", "producer", "--kv-port", "15000", "--device", "cpu") == {
        "kv_role": "kv_producer", "kv_connector": "ZmqTcpConnector", "kv_port": 15000}
    # on GPUs the blocks go device to device
    assert resolve("--kv-transfer-role", "consumer", "--device", "cuda")["kv_connector"] == "P2pNcclConnector"
    assert resolve("--kv-transfer-role", "consumer", "--kv-transfer-config", '{"kv_connector": "X"}') == {
        "kv_role": "kv_consumer", "kv_connector": "X"}
    with pytest.raises(ValueError, match="means kv_role 'kv_producer'"):
        resolve("--kv-transfer-role", "producer", "--kv-transfer-config", '{"kv_connector": "X", "kv_role": "kv_consumer"}')
    with pytest.raises(ValueError, match="need --kv-transfer-role"):
        resolve("--kv-port", "1")


def test_prefill_and_decode_instances_need_the_same_tensor_parallel_size() -> None:
    from minivllm.core.kv_connector.pd_connector import parse_remote_prefill

    params = {"remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 15000, "remote_block_ids": [0, 1],
              "tp_size": 2}
    assert parse_remote_prefill(params, 20, 16, tp_size=2) is params
    with pytest.raises(ValueError, match="tensor_parallel_size=2 and this one 1"):
        parse_remote_prefill(params, 20, 16, tp_size=1)


@pytest.mark.parametrize("token", [-1, 512, True, "7", 1.5])
def test_a_first_output_token_outside_the_vocabulary_is_refused(token) -> None:
    from minivllm.core.kv_connector.pd_connector import parse_remote_prefill

    params = {"remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 15000, "remote_block_ids": [0, 1]}
    assert parse_remote_prefill({**params, "first_output_token_id": 511}, 20, 16, vocab_size=512)
    with pytest.raises(ValueError, match=r"first_output_token_id'\] must be a token id in \[0, 512\)"):
        parse_remote_prefill({**params, "first_output_token_id": token}, 20, 16, vocab_size=512)
