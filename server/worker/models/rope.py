"""Rotary position embeddings (the "rotate half" layout of Hugging Face LLaMA checkpoints)."""

from __future__ import annotations

import math

import torch
from torch import nn


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    """Per-pair rotation frequencies, with ``linear`` or ``llama3`` scaling applied."""
    theta = float(params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", "default")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, params)
    raise ValueError(f"rope_type={rope_type!r} is not supported: choose one of ['default', 'linear', 'llama3']")


def _llama3_frequencies(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, and the band
    # between is interpolated smoothly (LLaMA 3.1's context extension).
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by their token positions, from a precomputed table."""

    def __init__(self, head_dim: int, max_positions: int, params: dict) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(head_dim, params)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [num_tokens]; q: [num_tokens, heads * head_dim]; k: [num_tokens, kv_heads * head_dim]
        cos = self.get_buffer("cos")[positions].unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.get_buffer("sin")[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        half = self.head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        out = x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
        return out.view(shape)


def rope_parameters_for(cfg: dict, layer_type: str | None = None) -> dict:
    """RoPE settings of one layer type, from either config style."""
    params = cfg.get("rope_parameters") or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params
