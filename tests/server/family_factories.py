"""Tiny random checkpoints of every decoder family, saved as transformers saves them."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.server.demo import BYTE_SPECIALS, build_byte_tokenizer

WINDOW = 24
"""Sliding window of the windowed tiny models: prompts in the tests are several windows long."""

_COMMON: dict[str, Any] = dict(
    vocab_size=256 + len(BYTE_SPECIALS),
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
    tie_word_embeddings=False,
)
_GEMMA: dict[str, Any] = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, num_hidden_layers=4)

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # name -> (transformers config class, overrides of _COMMON)
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen2-window": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, num_hidden_layers=3),
    ),
    "qwen3": ("Qwen3Config", dict(head_dim=32, attention_bias=True)),
    "phi3": ("Phi3Config", dict(num_key_value_heads=4, sliding_window=None)),
    "phi3-window": ("Phi3Config", dict(num_key_value_heads=4, sliding_window=WINDOW)),
    "mistral-window": ("MistralConfig", dict(sliding_window=WINDOW)),
    "gemma": ("GemmaConfig", dict(head_dim=16, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", dict(_GEMMA, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(_GEMMA, layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16, norm_topk_prob=False),
    ),
}

WINDOWED = ("qwen2-window", "phi3-window", "mistral-window", "gemma2", "gemma3", "mixtral")


def family_config(name: str):
    import transformers

    class_name, overrides = FAMILIES[name]
    return getattr(transformers, class_name)(**{**_COMMON, **overrides})


def save_tiny_family(path: str, name: str, seed: int = 0) -> str:
    """Write a random-weight model of family ``name`` with the byte tokenizer to ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name), attn_implementation="eager")
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(path)
    return path
