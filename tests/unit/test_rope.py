"""RoPE settings read from either config layout: transformers 4 (`rope_theta` + `rope_scaling`)
and transformers 5 (`rope_parameters`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from minivllm.worker.models.llama import rope_inv_freq, rope_parameters

LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def test_transformers5_layout() -> None:
    config = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    assert rope_parameters(config) == {"rope_type": "default", "rope_theta": 100000.0}


def test_transformers4_layout() -> None:
    plain = SimpleNamespace(rope_theta=500000.0, rope_scaling=None)
    assert rope_parameters(plain) == {"rope_type": "default", "rope_theta": 500000.0}
    scaled = SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3_SCALING})
    params = rope_parameters(scaled)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500000.0 and params["factor"] == 8.0
    assert rope_parameters(SimpleNamespace())["rope_theta"] == 10000.0  # Llama's default


@pytest.mark.parametrize("rope", [
    {"rope_theta": 12345.0},
    {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3_SCALING}},
    {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
], ids=["default", "llama3", "linear"])
def test_transformers4_config_json_matches_hf_rotary(tmp_path, rope) -> None:
    """A config.json written in transformers 4's layout, read through AutoConfig: our frequencies
    equal those of HF's own rotary embedding."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
              "intermediate_size": 128, "vocab_size": 100, **rope}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_config = AutoConfig.from_pretrained(tmp_path)
    inv_freq, scaling = rope_inv_freq(hf_config, head_dim=16)
    hf_rotary = LlamaRotaryEmbedding(hf_config)
    torch.testing.assert_close(inv_freq, hf_rotary.inv_freq.float(), rtol=0, atol=0)
    assert scaling == hf_rotary.attention_scaling
