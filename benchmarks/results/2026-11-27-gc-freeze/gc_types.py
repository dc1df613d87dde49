"""CPU: which tracked objects the frontend holds after generate() (by type), and how long a full pass takes."""
import gc, os, sys, time
from collections import Counter
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))  # (tests/)
from tests.tiny_models import build_tiny_model


def main():
    from minivllm.frontend.llm import LLM
    from minivllm.protocol.sampling_params import SamplingParams
    path = build_tiny_model("/tmp/gc_tiny_qwen3", arch="qwen3", max_position_embeddings=2048)
    rng = np.random.default_rng(0)
    n = 256
    in_lens = rng.integers(100, 1025, size=n)
    prompts = [{"prompt_token_ids": rng.integers(0, 200, size=int(k)).tolist()} for k in in_lens]
    with LLM(path, skip_tokenizer_init=True, max_model_len=2048) as llm:
        params = [SamplingParams(temperature=1.0, max_tokens=int(os.environ.get("OUTLEN", 64)), ignore_eos=True)] * n
        gc.collect()
        before = Counter(type(o).__name__ for o in gc.get_objects())
        print("tracked before", sum(before.values()), before.most_common(8))
        outs = llm.generate(prompts, params, use_tqdm=False)
        after = Counter(type(o).__name__ for o in gc.get_objects())
        print("tracked after", sum(after.values()), (after - before).most_common(12))
        t = time.perf_counter(); gc.collect(); print(f"full pass {1e3 * (time.perf_counter() - t):.1f} ms")
        del outs
        after2 = Counter(type(o).__name__ for o in gc.get_objects())
        print("after del outs", sum(after2.values()), (after2 - before).most_common(8))


if __name__ == "__main__":
    main()
