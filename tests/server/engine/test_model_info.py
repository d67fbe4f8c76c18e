"""What the engine reads from a model's config: the length limit and the window every layer shares."""

from __future__ import annotations

import pytest
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from pagedllm.server.config import ConfigError, EngineConfig
from pagedllm.server.engine.model_info import kv_window, load_tokenizer, max_model_len


def _saved(config) -> dict:
    """The config as its config.json holds it (what the engine reads)."""
    return config.to_dict()


@pytest.mark.parametrize(
    "config,window",
    [
        (MistralConfig(sliding_window=24), 24),
        (MistralConfig(sliding_window=None), None),
        (Phi3Config(sliding_window=2047), 2047),
        (MixtralConfig(), None),
        (LlamaConfig(), None),
        (Qwen2Config(), None),  # use_sliding_window is off by default
        (Qwen2Config(use_sliding_window=True, sliding_window=32, max_window_layers=0, num_hidden_layers=4), 32),
        (Qwen2Config(use_sliding_window=True, sliding_window=32, max_window_layers=2, num_hidden_layers=4), None),
        (Qwen3Config(use_sliding_window=True, sliding_window=64, max_window_layers=0, num_hidden_layers=2), 64),
        (Gemma2Config(sliding_window=16), None),  # global layers between the windowed ones
        (Gemma3TextConfig(sliding_window=16), None),
    ],
)
def test_kv_window_from_transformers_configs(config, window):
    assert kv_window(_saved(config)) == window


@pytest.mark.parametrize(
    "hf_config,window",
    [
        ({"sliding_window": 4096}, 4096),  # Mistral 7B v0.1
        ({"sliding_window": None}, None),
        ({"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28}, None),  # Qwen2 on the Hub
        ({"sliding_window": 10, "layer_types": ["sliding_attention"] * 3}, 10),
        ({"sliding_window": 10, "layer_types": ["sliding_attention", "full_attention"]}, None),
        ({"sliding_window": None, "layer_types": ["sliding_attention"] * 2}, None),
        ({"model_type": "gemma2", "sliding_window": 4096}, None),  # older Gemma 2: no layer_types
        ({"model_type": "gemma3_text", "sliding_window": 512, "sliding_window_pattern": 6}, None),
        ({}, None),
    ],
)
def test_kv_window_from_config_dicts(hf_config, window):
    assert kv_window(hf_config) == window


def test_a_window_does_not_cap_the_length():
    config = EngineConfig.from_kwargs()
    assert max_model_len(config, _saved(MistralConfig(sliding_window=24, max_position_embeddings=512))) == 512
    mistral = {"sliding_window": 24, "max_position_embeddings": 512}
    assert max_model_len(EngineConfig.from_kwargs(max_model_len=100), mistral) == 100
    with pytest.raises(ConfigError, match="at most the model's limit of 512"):
        max_model_len(EngineConfig.from_kwargs(max_model_len=513), mistral)


def test_a_model_directory_without_tokenizer_files_is_refused_by_name(tmp_path):
    """transformers builds the config's tokenizer class from no files at all, with one token that every
    text turns into nothing; the engine refuses it instead of answering every prompt as empty."""
    Qwen2Config(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no tokenizer at .* --tokenizer .* --skip-tokenizer-init"):
        load_tokenizer(str(tmp_path))
