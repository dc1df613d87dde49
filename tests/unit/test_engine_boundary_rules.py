"""The shared request checks (protocol/validation.py), engine keys and bind rules (protocol/auth.py),
and the private socket directory (protocol/ipc.py): no engine needed."""

from __future__ import annotations

import math
import os
import stat

import msgspec
import pytest

from minivllm.protocol.auth import CurveKeys, check_bind_allowed, is_local_address, read_engine_key_file
from minivllm.protocol.ipc import new_ipc_address, private_socket_dir
from minivllm.protocol.messages import EngineCoreOutput, EngineCoreRequest
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.serial import encode, engine_input_decoder
from minivllm.protocol.validation import EngineLimits, validate_request

LIMITS = EngineLimits(vocab_size=100, max_model_len=64, num_gpu_blocks=2, block_size=16)


def request(prompt=(1, 2, 3), **fields) -> EngineCoreRequest:
    params = fields.pop("sampling_params", SamplingParams(max_tokens=4))
    return EngineCoreRequest(request_id=fields.pop("request_id", "r"), prompt_token_ids=list(prompt),
                             sampling_params=params, arrival_time=fields.pop("arrival_time", 0.0), **fields)


@pytest.mark.parametrize("make, message", [
    (lambda: request(prompt=()), "the prompt is empty"),
    (lambda: request(prompt=[1] * 65), "more than max_model_len=64"),
    (lambda: request(prompt=[1, 100]), r"prompt token 100 is outside the vocabulary; ids must be in \[0, 100\)"),
    (lambda: request(prompt=[-5]), "prompt token -5 is outside"),
    (lambda: request(eos_token_ids=[100]), "eos_token_ids entry 100"),
    (lambda: request(sampling_params=SamplingParams(stop_token_ids=[500])), "stop_token_ids entry 500"),
    (lambda: request(sampling_params=SamplingParams(logit_bias={100: 1.0})), "logit_bias key 100"),
    (lambda: request(sampling_params=SamplingParams(allowed_token_ids=[3, 100])), "allowed_token_ids entry 100"),
    (lambda: request(sampling_params=SamplingParams(_bad_words_token_ids=[[1, 100]])), "bad_words token 100"),
    (lambda: request(priority=3), "scheduling_policy='priority'"),
    (lambda: request(arrival_time=math.nan), "arrival_time must be a finite number"),
    (lambda: request(cache_salt=""), "cache_salt must be a non-empty str"),
    (lambda: request(request_id=""), "request_id must be a string of 1 to 1024"),
    (lambda: request(sampling_params=SamplingParams(max_tokens=None)), r"more than the whole KV cache holds \(2 blocks"),
    (lambda: request(prompt=[1] * 30, sampling_params=SamplingParams(max_tokens=100)),
     "capped at max_model_len=64"),
])
def test_validate_request_says_what_and_the_allowed_range(make, message) -> None:
    with pytest.raises(ValueError, match=message):
        validate_request(make(), LIMITS)


def test_a_valid_request_passes_and_limits_are_rechecked_after_changes() -> None:
    ok = request(sampling_params=SamplingParams(max_tokens=4, logprobs=5, stop_token_ids=[99]))
    validate_request(ok, LIMITS)
    ok.sampling_params.n = 0  # changed after construction: caught again
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 128\]"):
        validate_request(ok, LIMITS)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=129), r"n must be an integer in \[1, 128\]"),
    (dict(temperature=math.nan), "temperature must be a finite number"),
    (dict(temperature=math.inf), "temperature must be a finite number"),
    (dict(top_k=2**40), r"top_k must be an integer in \[-1, 2147483647\]"),
    (dict(min_tokens=2**40, max_tokens=None), "min_tokens must be an integer in"),
    (dict(logprobs=21), r"logprobs must be an integer in \[0, 20\]"),
    (dict(logit_bias={1: 101.0}), r"logit_bias values must be in \[-100, 100\]"),
    (dict(logit_bias={1: math.nan}), "must be a finite number"),
    (dict(stop_token_ids=[1] * 1025), "at most 1024"),
    (dict(_bad_words_token_ids=[[]]), "each bad word must be 1 to 64 tokens"),
    (dict(presence_penalty=math.inf), "presence_penalty must be a finite number"),
])
def test_sampling_params_ranges(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_decoding_runs_the_same_checks() -> None:
    """Values off the wire go through SamplingParams.__post_init__: the decoder refuses them."""
    payload = msgspec.msgpack.encode({"type": "add", "request_id": "x", "prompt_token_ids": [1],
                                      "arrival_time": 0.0, "sampling_params": {"n": 10**9}})
    with pytest.raises(msgspec.ValidationError, match="n must be an integer"):
        engine_input_decoder.decode(payload)
    ok = engine_input_decoder.decode(encode(request()))
    validate_request(ok, LIMITS)


def test_refusal_travels_on_the_output() -> None:
    out = EngineCoreOutput("r", [], finish_reason="abort", error_type="overloaded", error="full")
    from minivllm.frontend.core_client import EngineOverloadedError, request_error

    decoded = msgspec.msgpack.decode(encode(out), type=EngineCoreOutput)
    assert isinstance(request_error(decoded), EngineOverloadedError)
    assert isinstance(request_error(msgspec.structs.replace(decoded, error_type="invalid")), ValueError)
    assert request_error(EngineCoreOutput("r", [1])) is None


def test_curve_keys_are_derived_deterministically_from_the_secret() -> None:
    a, b, c = CurveKeys("s" * 20), CurveKeys("s" * 20 + "\n"), CurveKeys("t" * 20)
    assert a.server_public == b.server_public and a.client_public == b.client_public
    assert a.server_public != c.server_public and a.client_public != a.server_public
    with pytest.raises(ValueError, match="at least 16 characters"):
        CurveKeys("short")


@pytest.mark.parametrize("address, local", [
    ("tcp://127.0.0.1:5570", True), ("tcp://localhost:1", True), ("tcp://[::1]:5", True),
    ("tcp://127.3.2.1:5", True), ("ipc:///tmp/x", True), ("tcp://0.0.0.0:5570", False),
    ("tcp://*:5570", False), ("tcp://10.0.0.5:5570", False), ("tcp://eth0:5570", False),
])
def test_which_addresses_are_local(address, local) -> None:
    assert is_local_address(address) is local


def test_non_loopback_bind_needs_a_key_or_insecure() -> None:
    check_bind_allowed("tcp://127.0.0.1:1", None, False)
    check_bind_allowed("tcp://0.0.0.0:1", "k" * 16, False)
    check_bind_allowed("tcp://0.0.0.0:1", None, True)
    with pytest.raises(ValueError, match="refusing to serve at tcp://0.0.0.0:1 without an engine key"):
        check_bind_allowed("tcp://0.0.0.0:1", None, False)


def test_key_file_readable_by_others_is_refused(tmp_path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("x" * 32 + "\n")
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match="readable by other users"):
        read_engine_key_file(str(key_file))
    key_file.chmod(0o600)
    assert read_engine_key_file(str(key_file)) == "x" * 32


def test_ipc_sockets_live_in_a_private_directory() -> None:
    path = private_socket_dir()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700 and os.stat(path).st_uid == os.getuid()
    assert new_ipc_address("engine").startswith(f"ipc://{path}/engine-")


def test_a_temperature_too_small_to_divide_by_means_greedy() -> None:
    """As in vLLM: 0 < temperature < 1e-5 is greedy (dividing logits by it would overflow)."""
    from minivllm.protocol.sampling_params import SamplingParams

    assert SamplingParams(temperature=1e-30).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
