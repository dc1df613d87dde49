"""Tiny random Llama-family checkpoints (+ a tiny trained tokenizer) for tests.

`build_tiny_model(path, arch)` writes a complete HF model directory — config.json, safetensors
weights, generation_config.json and a byte-level BPE tokenizer — in well under a second, so
every test can run the real loading path and compare against HF transformers token for token.

Archs:
  llama    LlamaForCausalLM, plain RoPE, untied lm_head
  llama3   LlamaForCausalLM with Llama-3 rope scaling (rope_type "llama3")
  qwen2    Qwen2ForCausalLM: q/k/v bias, tied embeddings
  qwen3    Qwen3ForCausalLM: per-head q/k RMSNorm, explicit head_dim, tied embeddings
  mistral  MistralForCausalLM (sliding window off)
"""

from __future__ import annotations

import os
from typing import Any

ARCHS: tuple[str, ...] = ("llama", "llama3", "qwen2", "qwen3", "mistral")

EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = 0  # special tokens come first in the trained vocab
TOKENIZER_VOCAB_SIZE = 400  # <= the model's vocab (512): real models pad their vocab too

# A little English for the BPE trainer; the merges only need to look plausible.
_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A paged attention kernel reads keys and values
from fixed-size blocks of memory, so many sequences can share one cache without fragmentation.
Once upon a time there was a little language model that wanted to generate text quickly.
It learned to batch requests together, to reuse its cache, and to schedule work fairly.
The scheduler hands out a budget of tokens each step; prefill chunks and decodes share it.
Hello world! How are you today? I am fine, thank you. What is the capital of France?
Paris is the capital of France. Berlin is the capital of Germany. Rome is in Italy.
One, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9 10 100 1000.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
In the beginning the engine was small, and then it grew into something useful for everyone.
"""


# A small chat template over the tiny vocabulary (its one special token stands in for BOS), for
# tests of chat rendering and of `minivllm generate`'s chat default.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _common_config(seed: int) -> dict[str, Any]:
    return dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: two query heads per KV head
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        # Large weights give peaked logits, so greedy argmax is far from ties and
        # fp32 reorderings between our kernels and HF's cannot flip a token.
        initializer_range=0.15,
        bos_token_id=EOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        torch_dtype="float32",
    )


def _arch_config(arch: str, seed: int) -> tuple[type, dict[str, Any]]:
    import transformers

    cfg = _common_config(seed)
    if arch == "llama":
        cfg.update(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        return transformers.LlamaConfig, cfg
    if arch == "llama3":
        cfg.update(
            num_hidden_layers=3,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # Small on purpose: with head_dim 16 this puts inv_freqs in all three
                # bands (kept / smoothed / divided by factor).
                "original_max_position_embeddings": 64,
            },
        )
        return transformers.LlamaConfig, cfg
    if arch == "qwen2":
        cfg.update(tie_word_embeddings=True, use_sliding_window=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        return transformers.Qwen2Config, cfg
    if arch == "qwen3":
        cfg.update(head_dim=24, tie_word_embeddings=True, use_sliding_window=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        return transformers.Qwen3Config, cfg
    if arch == "mistral":
        cfg.update(num_hidden_layers=3, sliding_window=None, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        return transformers.MistralConfig, cfg
    raise ValueError(f"unknown tiny arch {arch!r}; expected one of {', '.join(ARCHS)}")


def _model_class(arch: str) -> type:
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "llama3": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[arch]


def build_tiny_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE):
    """A byte-level BPE trained in-process, wrapped as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT.splitlines(), trainer=trainer)
    assert tokenizer.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=512,
    )


def build_tiny_model(
    path: str, arch: str = "llama", seed: int = 0, chat_template: str | None = None, **config_overrides: Any
) -> str:
    """Write a tiny random `arch` checkpoint + tokenizer to `path`; return `path`.

    chat_template: saved with the tokenizer (e.g. TINY_CHAT_TEMPLATE); none by default.

    config_overrides go straight into the HF config (e.g. attention_bias=True, mlp_bias=True,
    num_hidden_layers=1, tie_word_embeddings=True).
    """
    import torch
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bars in test output
    config_cls, cfg = _arch_config(arch, seed)
    cfg.update(config_overrides)
    config = config_cls(**cfg)

    torch.manual_seed(seed)
    model = _model_class(arch)(config).to(torch.float32).eval()
    _randomize_norms(model, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    GenerationConfig(
        bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID, do_sample=False
    ).save_pretrained(path)
    return path


def _randomize_norms(model, seed: int) -> None:
    """HF initializes RMSNorm weights (and biases) to constants; perturb them so a loader
    that forgets one (or maps it to the wrong layer) fails the comparison with HF."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
