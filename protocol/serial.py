"""msgpack encoding of protocol messages. One Encoder, and one typed Decoder per direction."""

from __future__ import annotations

from typing import Any, Union, get_args

import msgspec

from minivllm.protocol.messages import (
    AddRequests,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineToWorker,
    WorkerToEngine,
)

encoder = msgspec.msgpack.Encoder()


def encode(message: Any) -> bytes:
    return encoder.encode(message)


class RawAddRequests(msgspec.Struct, tag="add_many"):
    """AddRequests as the engine's socket thread reads it: each request left undecoded (the bytes of
    its msgpack value), to be decoded, checked and admitted on its own, so that the first ones can
    be scheduled while the rest are still being read (a 256-prompt batch: ~10 ms to decode whole)."""

    requests: list[msgspec.Raw]


# Decoders validate types as they parse: a malformed message fails here, not deep in the engine.
engine_input_decoder = msgspec.msgpack.Decoder(EngineCoreInput)
# What the engine's socket takes: EngineCoreInput, with a batch's requests left raw. And one such request.
engine_socket_decoder = msgspec.msgpack.Decoder(
    Union[tuple(RawAddRequests if kind is AddRequests else kind for kind in get_args(EngineCoreInput))])
request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
engine_output_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
worker_input_decoder = msgspec.msgpack.Decoder(EngineToWorker)
worker_output_decoder = msgspec.msgpack.Decoder(WorkerToEngine)
