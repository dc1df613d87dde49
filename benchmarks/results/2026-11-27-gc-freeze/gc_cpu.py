"""CPU: the 256-request workload's shape on a tiny Qwen3, with gcprobe on PYTHONPATH: how often and how
long each process's garbage collector runs during generate()."""
import os, sys, time
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))  # (tests/)
from tests.tiny_models import build_tiny_model


def main():
    from minivllm.frontend.llm import LLM
    from minivllm.protocol.sampling_params import SamplingParams
    path = build_tiny_model("/tmp/gc_tiny_qwen3", arch="qwen3", max_position_embeddings=2048)
    rng = np.random.default_rng(0)
    n = int(os.environ.get("N", 256))
    in_lens = rng.integers(100, 1025, size=n)
    prompts = [{"prompt_token_ids": rng.integers(0, 200, size=int(k)).tolist()} for k in in_lens]
    with LLM(path, skip_tokenizer_init=True, max_model_len=2048) as llm:
        params = [SamplingParams(temperature=1.0, max_tokens=int(os.environ.get("OUTLEN", 256)), ignore_eos=True)] * n
        llm.generate(prompts[:8], params[:8], use_tqdm=False)
        t0 = time.perf_counter(); print(f"generate starts at {time.time() % 1000:.2f}", flush=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        print(f"generate ends at {time.time() % 1000:.2f}", flush=True)
        print(f"elapsed {time.perf_counter() - t0:.2f} s, {sum(len(o.outputs[0].token_ids) for o in outs)} tokens",
              flush=True)


if __name__ == "__main__":
    main()
