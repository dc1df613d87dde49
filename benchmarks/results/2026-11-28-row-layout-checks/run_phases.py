"""The 256-request workload (bench's: inputs 100-1,024, outputs 256, temperature 1) in two phases
per run: the prompt phase (to the last request's first token) and the decode phase after it. The
request admitted last makes one token per step from its first on, so its token times are the
decode phase's step times. To see whether a slow run lost its time in the prompt steps or in every
decode step."""
import builtins
import os
import sys
import time

import numpy as np


def main() -> None:
    from minivllm.frontend.llm import LLM
    from minivllm.protocol.sampling_params import SamplingParams
    fp8 = "--fp8" in sys.argv
    rng = np.random.default_rng(0)
    n = 256
    in_lens = rng.integers(100, 1025, size=n)
    prompts = [{"prompt_token_ids": rng.integers(0, 151000, size=int(k)).tolist()} for k in in_lens]
    kw = dict(load_format="dummy", skip_tokenizer_init=True)
    if fp8:
        kw["kv_cache_dtype"] = "fp8"
    mark = getattr(builtins, "__timeline_mark__", lambda label: None)  # (benchmarks/timeline's, when loaded)
    with LLM("benchmarks/configs/qwen3-0.6b", **kw) as llm:
        params = SamplingParams(temperature=1.0, max_tokens=256, ignore_eos=True)
        for rep in range(int(os.environ.get("REPS", 1))):
            llm.generate(prompts[:8], params, use_tqdm=False)
            llm.reset_prefix_cache()
            mark(f"> rep {rep}")
            t0w, t0 = time.time(), time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            mark(f"< rep {rep}")
            last_in = max(outs, key=lambda o: o.metrics.first_token_time)
            steps = np.diff(last_in.metrics.token_times) * 1e3
            prompt_phase = (last_in.metrics.first_token_time - t0w) * 1e3
            print(f"{'fp8' if fp8 else 'bf16'} rep {rep}: elapsed {elapsed * 1e3:.1f} ms; prompt phase {prompt_phase:.1f} ms; "
                  f"decode phase {steps.sum():.1f} ms in {steps.size} steps: p10 {np.percentile(steps, 10):.3f} "
                  f"p50 {np.median(steps):.3f} p90 {np.percentile(steps, 90):.3f} max {steps.max():.2f}; "
                  f"by quarter {[round(float(q.mean()), 3) for q in np.array_split(steps, 4)]}; "
                  f"the largest step ended at {last_in.metrics.token_times[int(steps.argmax()) + 1] % 1000:.2f}; "
                  f"steps over 8 ms {(steps > 8).sum()}", flush=True)


if __name__ == "__main__":
    main()
