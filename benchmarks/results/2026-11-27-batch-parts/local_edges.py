"""Local (CPU) timeline of a 256-prompt batch's first ~100 ms on a tiny model: when does the first step start?"""
import os, sys, time
import numpy as np
sys.path.insert(0, "/work/main")
from tests.tiny_models import build_tiny_model
path = "/tmp/tl/tiny"
if not os.path.exists(path + "/config.json"):
    build_tiny_model(path, max_position_embeddings=2048)
from minivllm.frontend.llm import LLM
from minivllm.protocol.sampling_params import SamplingParams
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": rng.integers(3, 500, size=int(k)).tolist()} for k in rng.integers(100, 1025, size=256)]
with LLM(path, skip_tokenizer_init=True, max_model_len=2048, max_num_batched_tokens=int(os.environ.get("BUDGET", 16384))) as llm:
    params = [SamplingParams(max_tokens=2, ignore_eos=True)] * 256
    llm.generate(prompts[:8], params[:8], use_tqdm=False); llm.reset_prefix_cache()
    t0 = time.perf_counter(); llm.generate(prompts, params, use_tqdm=False); print(f"elapsed {1e3*(time.perf_counter()-t0):.0f} ms")
