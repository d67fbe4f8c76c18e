"""The LLaMA family (LLaMA 1/2/3, Mistral-style GQA and sliding window) written for paged attention.

Parameter names follow the Hugging Face checkpoints (``model.layers.0.self_attn.q_proj``),
so loading is a name-for-name copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.server.worker.attention import AttentionMetadata, AttentionOps, PagedAttention
from pagedllm.server.worker.models.checkpoint import copy_weights
from pagedllm.server.worker.models.rope import RotaryEmbedding
from pagedllm.server.worker.models.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)


@dataclass(frozen=True)
class LlamaArch:
    """The architecture numbers the model needs, read from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    rope: dict
    sliding_window: int | None = None
    """Every layer's attention window (Mistral); None: full causal attention."""

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaArch:
        heads = cfg["num_attention_heads"]
        act = cfg.get("hidden_act", "silu")
        if act not in _ACTS:
            raise ValueError(f"hidden_act={act!r} is not supported: choose one of {sorted(_ACTS)}")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=act,
            rope=rope_parameters(cfg),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
        )


_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": nn.functional.silu, "gelu": nn.functional.gelu}


def rope_parameters(cfg: dict) -> dict:
    """RoPE settings from either config style (``rope_theta`` + ``rope_scaling``, or ``rope_parameters``)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, arch: LlamaArch, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        d, bias, hidden = arch.head_dim, arch.attention_bias, arch.hidden_size
        h = tp.split(arch.num_heads, "number of attention heads")
        kvh, first_kv = tp.kv_heads(arch.num_kv_heads)
        self.q_proj = ColumnParallelLinear(hidden, arch.num_heads * d, bias, tp)
        self.k_proj = ColumnParallelLinear(hidden, kvh * d, bias, tp, first_row=first_kv * d)
        self.v_proj = ColumnParallelLinear(hidden, kvh * d, bias, tp, first_row=first_kv * d)
        self.o_proj = RowParallelLinear(arch.num_heads * d, hidden, bias, tp)
        self.rotary = rotary
        self.attn = PagedAttention(h, kvh, d, scale=1.0 / math.sqrt(d), sliding_window=arch.sliding_window)

    def forward(self, x, positions, kv_cache, meta: AttentionMetadata, ops: AttentionOps):
        q, k = self.rotary(positions, self.q_proj(x), self.k_proj(x))
        return self.o_proj(self.attn(q, k, self.v_proj(x), kv_cache, meta, ops))


class LlamaMLP(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPGroup) -> None:
        super().__init__()
        hidden, inner, bias = arch.hidden_size, arch.intermediate_size, arch.mlp_bias
        self.gate_proj = ColumnParallelLinear(hidden, inner, bias, tp)
        self.up_proj = ColumnParallelLinear(hidden, inner, bias, tp)
        self.down_proj = RowParallelLinear(inner, hidden, bias, tp)
        self.act = _ACTS[arch.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, rotary, tp)
        self.mlp = LlamaMLP(arch, tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, positions, kv_cache, meta, ops):
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta, ops)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPGroup) -> None:
        super().__init__()
        rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, rotary, tp) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Token ids and positions in, final hidden states out; logits only where asked."""

    def __init__(self, arch: LlamaArch, tp: TPGroup) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.model = LlamaModel(arch, tp)
        tied = self.model.embed_tokens if arch.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(arch.hidden_size, arch.vocab_size, tp, tied=tied)

    @classmethod
    def from_hf_config(cls, cfg: dict, tp: TPGroup = TPGroup()) -> LlamaForCausalLM:
        return cls(LlamaArch.from_hf(cfg), tp)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of this rank's KV cache."""
        return self.arch.num_layers, self.tp.kv_heads(self.arch.num_kv_heads)[0], self.arch.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        ops: AttentionOps,
    ) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden_size]
        x = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, positions, kv_cache, meta, ops)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name; every parameter must be found once."""
        tied = self.arch.tie_word_embeddings
        kept = (
            (name, tensor)
            for name, tensor in weights
            if "rotary_emb" not in name and not (tied and name == "lm_head.weight")
        )
        copy_weights(self, kept, "LLaMA")
