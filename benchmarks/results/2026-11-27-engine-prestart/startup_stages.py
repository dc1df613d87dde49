"""(A probe, as it ran on the 2-core box: the frontend's start-up stages, the engine started after its config.)"""
import time
t0 = time.perf_counter()
def mark(what): print(f"{time.perf_counter() - t0:6.2f} s  {what}", flush=True)
from minivllm.frontend.model_download import resolve_model  # noqa
from minivllm.protocol.config import EngineConfig
from minivllm.frontend.core_client import EngineCoreClient
mark("imports")
import sys
m = resolve_model(None) if len(sys.argv) < 2 else sys.argv[1]
mark("resolve_model")
config = EngineConfig.create(m, usage_context="LLM_CLASS")
mark("EngineConfig.create")
import sys as _s; mark(f"torch imported in frontend: {'torch' in _s.modules}, transformers: {'transformers' in _s.modules}")
client = EngineCoreClient.spawn(config)
mark("EngineCoreClient.spawn (engine ready)")
from minivllm.frontend.input_processor import InputProcessor
ip = InputProcessor.for_engine(client.engine_info, False)
mark("InputProcessor (tokenizer)")
client.shutdown()
mark("shutdown")
