"""Meta's OPT family (125M - 66B) written for paged attention.

What sets OPT apart from LLaMA: learned absolute positions looked up at ``position + 2``
(a fairseq leftover: rows 0 and 1 of the table are never used), LayerNorm with biases,
either before each block (``do_layer_norm_before``, most sizes) or after it (350M), a
ReLU feed-forward, and, when ``word_embed_proj_dim != hidden_size`` (350M), token
embeddings and the tied head living in the smaller dimension::

    ids -> embed_tokens [word_dim] -> project_in -> + embed_positions[pos + 2] -> layers
        -> final_layer_norm (pre-LN only) -> project_out [word_dim] -> lm_head

Parameter names follow the Hugging Face checkpoints (``model.decoder.layers.0.fc1``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.server.worker.attention import AttentionMetadata, AttentionOps, PagedAttention
from pagedllm.server.worker.models.activations import activation
from pagedllm.server.worker.models.checkpoint import copy_weights, require
from pagedllm.server.worker.models.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)

POSITION_OFFSET = 2  # NOTE: OPT's position table has 2 extra leading rows; position p reads row p + 2.


@dataclass(frozen=True)
class OPTArch:
    """The architecture numbers the model needs, read from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    word_embed_proj_dim: int
    ffn_dim: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    do_layer_norm_before: bool
    final_layer_norm: bool
    enable_bias: bool
    layer_norm_affine: bool
    activation_function: str
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> OPTArch:
        hidden, heads = require(cfg, "hidden_size"), require(cfg, "num_attention_heads")
        if hidden % heads:
            raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        act = cfg.get("activation_function", "relu")
        activation(act, "activation_function")
        pre = bool(cfg.get("do_layer_norm_before", True))
        return cls(
            vocab_size=require(cfg, "vocab_size"),
            hidden_size=hidden,
            word_embed_proj_dim=cfg.get("word_embed_proj_dim") or hidden,
            ffn_dim=require(cfg, "ffn_dim"),
            num_layers=require(cfg, "num_hidden_layers"),
            num_heads=heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            do_layer_norm_before=pre,
            final_layer_norm=pre and not cfg.get("_remove_final_layer_norm", False),
            enable_bias=bool(cfg.get("enable_bias", True)),
            layer_norm_affine=bool(cfg.get("layer_norm_elementwise_affine", True)),
            activation_function=act,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class OPTAttention(nn.Module):
    def __init__(self, arch: OPTArch, tp: TPGroup) -> None:
        super().__init__()
        h, bias = arch.hidden_size, arch.enable_bias
        heads = tp.split(arch.num_heads, "number of attention heads")
        self.q_proj = ColumnParallelLinear(h, h, bias, tp)
        self.k_proj = ColumnParallelLinear(h, h, bias, tp)
        self.v_proj = ColumnParallelLinear(h, h, bias, tp)
        self.out_proj = RowParallelLinear(h, h, bias, tp)
        self.attn = PagedAttention(heads, heads, arch.head_dim, scale=1.0 / math.sqrt(arch.head_dim))

    def forward(self, x, kv_cache, meta: AttentionMetadata, ops: AttentionOps) -> torch.Tensor:
        return self.out_proj(self.attn(self.q_proj(x), self.k_proj(x), self.v_proj(x), kv_cache, meta, ops))


class OPTDecoderLayer(nn.Module):
    def __init__(self, arch: OPTArch, tp: TPGroup) -> None:
        super().__init__()
        self.pre_norm = arch.do_layer_norm_before
        self.self_attn = OPTAttention(arch, tp)
        self.self_attn_layer_norm = nn.LayerNorm(arch.hidden_size, elementwise_affine=arch.layer_norm_affine)
        self.fc1 = ColumnParallelLinear(arch.hidden_size, arch.ffn_dim, arch.enable_bias, tp)
        self.fc2 = RowParallelLinear(arch.ffn_dim, arch.hidden_size, arch.enable_bias, tp)
        self.final_layer_norm = nn.LayerNorm(arch.hidden_size, elementwise_affine=arch.layer_norm_affine)
        self.act = activation(arch.activation_function, "activation_function")

    def _residual(self, x: torch.Tensor, norm: nn.LayerNorm, block) -> torch.Tensor:
        # Pre-LN: x + f(norm(x)); post-LN (350M): norm(x + f(x)).
        return x + block(norm(x)) if self.pre_norm else norm(x + block(x))

    def forward(self, x, kv_cache, meta, ops):
        x = self._residual(x, self.self_attn_layer_norm, lambda h: self.self_attn(h, kv_cache, meta, ops))
        return self._residual(x, self.final_layer_norm, lambda h: self.fc2(self.act(self.fc1(h))))


class OPTDecoder(nn.Module):
    def __init__(self, arch: OPTArch, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.word_embed_proj_dim, tp)
        self.embed_positions = nn.Embedding(arch.max_position_embeddings + POSITION_OFFSET, arch.hidden_size)
        projected = arch.word_embed_proj_dim != arch.hidden_size
        self.project_in = nn.Linear(arch.word_embed_proj_dim, arch.hidden_size, bias=False) if projected else None
        self.project_out = nn.Linear(arch.hidden_size, arch.word_embed_proj_dim, bias=False) if projected else None
        self.layers = nn.ModuleList(OPTDecoderLayer(arch, tp) for _ in range(arch.num_layers))
        self.final_layer_norm = (
            nn.LayerNorm(arch.hidden_size, elementwise_affine=arch.layer_norm_affine) if arch.final_layer_norm else None
        )


class OPTModel(nn.Module):
    def __init__(self, arch: OPTArch, tp: TPGroup) -> None:
        super().__init__()
        self.decoder = OPTDecoder(arch, tp)


class OPTForCausalLM(nn.Module):
    """Token ids and positions in, final hidden states out; logits only where asked."""

    def __init__(self, arch: OPTArch, tp: TPGroup) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.model = OPTModel(arch, tp)
        tied = self.model.decoder.embed_tokens if arch.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(arch.word_embed_proj_dim, arch.vocab_size, tp, tied=tied)

    @classmethod
    def from_hf_config(cls, cfg: dict, tp: TPGroup = TPGroup()) -> OPTForCausalLM:
        return cls(OPTArch.from_hf(cfg), tp)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of this rank's KV cache."""
        return self.arch.num_layers, self.arch.num_heads // self.tp.size, self.arch.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        ops: AttentionOps,
    ) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden_size]
        decoder = self.model.decoder
        x = decoder.embed_tokens(input_ids)
        if decoder.project_in is not None:
            x = decoder.project_in(x)
        x = x + decoder.embed_positions(positions + POSITION_OFFSET)
        for layer, kv_cache in zip(decoder.layers, kv_caches):
            x = layer(x, kv_cache, meta, ops)
        return decoder.final_layer_norm(x) if decoder.final_layer_norm is not None else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # NOTE: project_out is linear and comes last, so it runs here on the sampled rows only.
        project_out = self.model.decoder.project_out
        if project_out is not None:
            hidden = project_out(hidden)
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name; every parameter must be found once.

        Older checkpoints name tensors ``decoder.*`` rather than ``model.decoder.*``.
        """
        copy_weights(self, self._renamed(weights), "OPT")

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, tensor in weights:
            if name.startswith("decoder."):
                name = "model." + name
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            yield name, tensor
