"""OpenAI's GPT-2 family written for paged attention.

GPT-2 checkpoints store their projections as ``Conv1D`` weights laid out ``[in, out]``
(the transpose of ``nn.Linear``); they are transposed once, on load. The query, key and
value projections are one fused ``c_attn`` of width ``3 * hidden``. Positions are a
learned table ``wpe`` (no offset), layer norms come before each block, and the head
shares the token embedding ``wte`` unless ``tie_word_embeddings`` is false.

Parameter names follow the Hugging Face checkpoints (``transformer.h.0.attn.c_attn``).
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
    mark_shard,
)

# Conv1D parameters, stored [in, out] in checkpoints and [out, in] here.
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers some checkpoints carry (the causal mask and its fill value): not parameters.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


@dataclass(frozen=True)
class GPT2Arch:
    """The architecture numbers the model needs, read from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    inner_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    layer_norm_eps: float
    activation_function: str
    scale_attn_weights: bool
    scale_attn_by_inverse_layer_idx: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> GPT2Arch:
        hidden, heads = require(cfg, "n_embd", "hidden_size"), require(cfg, "n_head", "num_attention_heads")
        if hidden % heads:
            raise ValueError(f"n_embd={hidden} is not divisible by n_head={heads}")
        if cfg.get("add_cross_attention"):
            raise ValueError(
                "add_cross_attention=True is not supported: GPT-2 runs here as a decoder-only "
                "model (use a checkpoint with add_cross_attention=False)"
            )
        act = cfg.get("activation_function", "gelu_new")
        activation(act, "activation_function")
        return cls(
            vocab_size=require(cfg, "vocab_size"),
            hidden_size=hidden,
            inner_size=cfg.get("n_inner") or 4 * hidden,
            num_layers=require(cfg, "n_layer", "num_hidden_layers"),
            num_heads=heads,
            max_position_embeddings=require(cfg, "n_positions", "max_position_embeddings"),
            layer_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            activation_function=act,
            scale_attn_weights=bool(cfg.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(cfg.get("scale_attn_by_inverse_layer_idx", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def attention_scale(self, layer_idx: int) -> float:
        """Softmax scale of layer ``layer_idx``: 1/sqrt(head_dim) if scaled, further / (layer_idx + 1)."""
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale_attn_weights else 1.0
        return scale / (layer_idx + 1) if self.scale_attn_by_inverse_layer_idx else scale


class GPT2Attention(nn.Module):
    def __init__(self, arch: GPT2Arch, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        hidden = arch.hidden_size
        heads = tp.split(arch.num_heads, "number of attention heads")
        self.local_width = heads * arch.head_dim
        # NOTE: the fused QKV weight is [q; k; v] by rows: a rank keeps its heads' rows of each third.
        self.c_attn = nn.Linear(hidden, 3 * self.local_width)
        if tp.size > 1:
            start, width = tp.rank * self.local_width, self.local_width

            def fused(full: torch.Tensor) -> torch.Tensor:
                return torch.cat([third.narrow(0, start, width) for third in full.split(hidden, dim=0)])

            mark_shard(self.c_attn.weight, fused)
            mark_shard(self.c_attn.bias, fused)
        self.c_proj = RowParallelLinear(hidden, hidden, True, tp)
        self.attn = PagedAttention(heads, heads, arch.head_dim, arch.attention_scale(layer_idx))

    def forward(self, x, kv_cache, meta: AttentionMetadata, ops: AttentionOps) -> torch.Tensor:
        # qkv: [num_tokens, 3 * local_width] -> q, k, v: [num_tokens, local_width] each
        q, k, v = self.c_attn(x).split(self.local_width, dim=-1)
        return self.c_proj(self.attn(q, k, v, kv_cache, meta, ops))


class GPT2MLP(nn.Module):
    def __init__(self, arch: GPT2Arch, tp: TPGroup) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(arch.hidden_size, arch.inner_size, True, tp)
        self.c_proj = RowParallelLinear(arch.inner_size, arch.hidden_size, True, tp)
        self.act = activation(arch.activation_function, "activation_function")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, arch: GPT2Arch, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)
        self.attn = GPT2Attention(arch, layer_idx, tp)
        self.ln_2 = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)
        self.mlp = GPT2MLP(arch, tp)

    def forward(self, x, kv_cache, meta, ops):
        x = x + self.attn(self.ln_1(x), kv_cache, meta, ops)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, arch: GPT2Arch, tp: TPGroup) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.wpe = nn.Embedding(arch.max_position_embeddings, arch.hidden_size)
        self.h = nn.ModuleList(GPT2Block(arch, i, tp) for i in range(arch.num_layers))
        self.ln_f = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)


class GPT2LMHeadModel(nn.Module):
    """Token ids and positions in, final hidden states out; logits only where asked."""

    def __init__(self, arch: GPT2Arch, tp: TPGroup) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.transformer = GPT2Model(arch, tp)
        tied = self.transformer.wte if arch.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(arch.hidden_size, arch.vocab_size, tp, tied=tied)

    @classmethod
    def from_hf_config(cls, cfg: dict, tp: TPGroup = TPGroup()) -> GPT2LMHeadModel:
        return cls(GPT2Arch.from_hf(cfg), tp)

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
        x = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        for block, kv_cache in zip(self.transformer.h, kv_caches):
            x = block(x, kv_cache, meta, ops)
        return self.transformer.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name, transposing Conv1D weights; every parameter once.

        The original OpenAI checkpoints name tensors without the ``transformer.`` prefix.
        """
        copy_weights(self, self._renamed(weights), "GPT-2")

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, tensor in weights:
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name
            if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.arch.tie_word_embeddings):
                continue
            if name.endswith(CONV1D_SUFFIXES):
                if tensor.dim() != 2:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}: "
                        "a Conv1D weight must be 2-D [in, out]"
                    )
                tensor = tensor.t()
            yield name, tensor
