"""msgpack encoding of protocol messages. One Encoder, and one typed Decoder per direction."""

from __future__ import annotations

from typing import Any

import msgspec

from minivllm.protocol.messages import (
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineToWorker,
    WorkerToEngine,
)

encoder = msgspec.msgpack.Encoder()


def encode(message: Any) -> bytes:
    return encoder.encode(message)


# Decoders validate types as they parse: a malformed message fails here, not deep in the engine.
engine_input_decoder = msgspec.msgpack.Decoder(EngineCoreInput)
request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)  # one request of an AddRequests that failed whole
engine_output_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
worker_input_decoder = msgspec.msgpack.Decoder(EngineToWorker)
worker_output_decoder = msgspec.msgpack.Decoder(WorkerToEngine)
