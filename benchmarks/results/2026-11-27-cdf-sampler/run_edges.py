"""Where the measured run's wall time goes at its edges: generate()'s start to the first token seen,
the steps in between, the last token to generate()'s return. Same workload and warm-up as bench."""
import sys, time
import numpy as np

def main():
    from minivllm.frontend.llm import LLM
    from minivllm.protocol.sampling_params import SamplingParams
    fp8 = "--fp8" in sys.argv
    rng = np.random.default_rng(0)
    import os; n = int(os.environ.get("N", 256))
    nano = "--nano" in sys.argv
    in_lens = rng.integers(100, 1025, size=n)
    out_lens = rng.integers(100, 1025, size=n) if nano else rng.integers(int(os.environ.get("OUTLEN", 256)), int(os.environ.get("OUTLEN", 256)) + 1, size=n)
    prompts = [{"prompt_token_ids": rng.integers(0, 151000, size=int(k)).tolist()} for k in in_lens]
    kw = dict(load_format="dummy", skip_tokenizer_init=True)
    if fp8: kw["kv_cache_dtype"] = "fp8"
    with LLM("benchmarks/configs/qwen3-0.6b", **kw) as llm:
        params = [SamplingParams(temperature=0.6 if nano else 1.0, max_tokens=int(k), ignore_eos=True) for k in out_lens]
        for rep in range(int(os.environ.get("REPS", 1))):
            llm.generate(prompts[:8], params[:8], use_tqdm=False); llm.reset_prefix_cache()
            t0w = time.time(); t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            t1 = time.perf_counter(); el = t1 - t0
            first = min(o.metrics.first_token_time for o in outs) - t0w
            last = max(o.metrics.token_times[-1] for o in outs) - t0w
            times = sorted({round(t - t0w, 6) for o in outs for t in o.metrics.token_times})
            gaps = np.diff(times)
            print(f"{time.time() % 1000:.2f} {'nano ' if nano else ''}{'fp8' if fp8 else 'bf16'} rep {rep}: elapsed {el*1e3:.1f} ms, {sum(len(o.outputs[0].token_ids) for o in outs)/el:.0f} tok/s; first token {first*1e3:.1f} ms, "
                  f"last token {last*1e3:.1f} ms, return {(el-last)*1e3:.1f} ms after it; {len(times)} distinct token times; "
                  f"gaps ms p50 {np.median(gaps)*1e3:.2f} max {gaps.max()*1e3:.2f}; first 12 gaps {np.round(gaps[:12]*1e3,1).tolist()}; last 12 {np.round(gaps[-12:]*1e3,1).tolist()}")

if __name__ == "__main__":
    main()
