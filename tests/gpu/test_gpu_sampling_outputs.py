"""prompt_logprobs and bad_words on CUDA (CUDA graphs on, small chunks): fp32 prompt logprobs equal
the CPU reference path's, and the fused sampler's rows obey bad words."""

from __future__ import annotations

from minivllm import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 400 + 1 for j in range(n)]} for i, n in enumerate([1, 9, 40, 130])]
PROMPT_LOGPROB_TOLERANCE = 1e-3  # fp32 on both devices; kernels sum in other orders


def prompt_logprobs(model_dir: str, **kwargs) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    with LLM(model_dir, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, **kwargs) as llm:
        return [o.prompt_logprobs for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_prompt_logprobs_cuda_equal_cpu(tiny_llama) -> None:
    expected = prompt_logprobs(tiny_llama, device="cpu")
    got = prompt_logprobs(tiny_llama, device="cuda", dtype="float32")
    for ours, ref in zip(got, expected):
        assert len(ours) == len(ref) and ours[0] is None
        for a, b in zip(ours[1:], ref[1:]):
            assert set(a) == set(b)
            assert all(abs(a[t].logprob - b[t].logprob) < PROMPT_LOGPROB_TOLERANCE for t in a)


def test_bad_words_on_the_fused_sampler(tiny_llama) -> None:
    with LLM(tiny_llama, device="cuda", max_model_len=256, max_num_seqs=8) as llm:
        tokenizer = llm.get_tokenizer()
        banned = {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("Fr", " Fr", "is", " is")}
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=64, ignore_eos=True, bad_words=["Fr", "is"])
        outs = llm.generate(["The quick brown fox"] * 4, params, use_tqdm=False)
    assert all(not banned & set(o.outputs[0].token_ids) for o in outs)
