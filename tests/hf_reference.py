"""HF transformers as the reference the engine is compared with."""

from __future__ import annotations

import torch


def hf_greedy(model_dir: str, prompt_ids: list[list[int]], max_tokens: int, eos_token_id: int) -> list[list[int]]:
    """HF `generate`, greedy, fp32, one prompt at a time (no padding), each cut after its first EOS
    as the engine stops there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for ids in prompt_ids:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=eos_token_id, pad_token_id=eos_token_id)
        new = out[0, len(ids):].tolist()
        results.append(new[: new.index(eos_token_id) + 1] if eos_token_id in new else new)
    return results
