"""One decoder-only transformer for every LLaMA-like family, built from its Hugging Face config.

Parameter names are the Hugging Face ones (``model.layers.0.self_attn.q_proj``); families
whose checkpoints fuse or rename tensors are mapped onto them by families.py. A layer::

    x ─ input_layernorm ─ attention ─(post_attention_layernorm)─ + ─ norm ─ MLP or MoE ─(post_ffn norm)─ +
    └──────────────────────────────────────────────────────────┘ └────────────────────────────────────┘

The norms in brackets exist in Gemma's "sandwich" layout only; there the norm before the
MLP is ``pre_feedforward_layernorm``, in LLaMA's it is ``post_attention_layernorm``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.kernels import runs_on_triton
from pagedllm.kernels.fused_add_rms_norm import fused_add_rms_norm, rms_norm
from pagedllm.kernels.rms_norm_cpu import rms_norm_cpu
from pagedllm.kernels.silu_and_mul import act_and_mul
from pagedllm.kernels.silu_and_mul_cpu import silu_and_mul_cpu
from pagedllm.server.worker.attention import AttentionMetadata, AttentionOps, PagedAttention
from pagedllm.server.worker.models.activations import activation
from pagedllm.server.worker.models.decoder_arch import DecoderArch
from pagedllm.server.worker.models.families import load_decoder_weights
from pagedllm.server.worker.models.fused_linear import fuse_linears
from pagedllm.server.worker.models.rope import RotaryEmbedding
from pagedllm.server.worker.models.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from pagedllm.server.worker.quantization.linear import QuantLinear


def _column(arch: DecoderArch, size: tuple[int, int], bias: bool, tp: TPGroup, first_row: int | None = None):
    """A column-parallel projection [in, out]: quantized when the checkpoint is."""
    if arch.quant is not None:
        return QuantLinear(arch.quant, *size, bias, tp, first_row=first_row)
    return ColumnParallelLinear(*size, bias, tp, first_row=first_row)


def _row(arch: DecoderArch, size: tuple[int, int], bias: bool, tp: TPGroup):
    """A row-parallel projection [in, out]: quantized when the checkpoint is."""
    if arch.quant is not None:
        return QuantLinear(arch.quant, *size, bias, tp, row_parallel=True)
    return RowParallelLinear(*size, bias, tp)


class RMSNorm(nn.Module):
    """RMSNorm as LLaMA writes it (``w * x``, cast first) or as Gemma does (``(1 + w) * x``, in float32)."""

    def __init__(self, size: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if gemma else torch.ones(size))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if runs_on_triton(x):
            return rms_norm(x, self.weight, self.eps, self.gemma)
        if self.gemma:
            dtype = x.dtype
            normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
            return (normed * (1.0 + self.weight.float())).to(dtype)
        return rms_norm_cpu(x, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), in one pass where the compiled kernel runs (LLaMA's norms).

        NOTE: on CUDA the Triton kernel writes both results in place, over ``x`` and ``residual``:
        the callers' tensors are a sub-layer's fresh output and the residual stream they own.
        """
        if runs_on_triton(x):
            return fused_add_rms_norm(x, residual, self.weight, self.eps, self.gemma)
        if self.gemma:
            summed = x + residual
            return self(summed), summed
        return rms_norm_cpu(x, self.weight, self.eps, residual)


class DecoderAttention(nn.Module):
    def __init__(self, arch: DecoderArch, layer: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        d, hidden = arch.head_dim, arch.hidden_size
        self.num_heads = tp.split(arch.num_heads, "number of attention heads")
        self.num_kv_heads, first_kv = tp.kv_heads(arch.num_kv_heads)
        self.head_dim = d
        self.q_proj = _column(arch, (hidden, arch.num_heads * d), arch.qkv_bias, tp)
        self.k_proj = _column(arch, (hidden, self.num_kv_heads * d), arch.qkv_bias, tp, first_row=first_kv * d)
        self.v_proj = _column(arch, (hidden, self.num_kv_heads * d), arch.qkv_bias, tp, first_row=first_kv * d)
        self.o_proj = _row(arch, (arch.num_heads * d, hidden), arch.o_bias, tp)
        self.qkv_proj: nn.Module | None = None
        """q, k and v in one GEMM, once :meth:`fuse_projections` has replaced the three."""
        self.qk_norm = arch.family.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps, arch.family.gemma_norms)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps, arch.family.gemma_norms)
        self.rotary = rotary
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            d,
            scale=arch.attn_scale,
            sliding_window=arch.layer_windows[layer],
            logit_softcap=arch.attn_softcap,
        )

    def fuse_projections(self) -> None:
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if self.qkv_proj is not None:
            del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, positions, kv_cache, meta: AttentionMetadata, ops: AttentionOps):
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm:
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim)).view(q.shape)
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim)).view(k.shape)
        # NOTE: forward, not __call__, for the modules nothing hooks (about 0.5 us a call at decode
        # sizes); the projections are called, as LoRA hooks them
        q, k = self.rotary.forward(positions, q, k)
        return self.o_proj(self.attn.forward(q, k, v, kv_cache, meta, ops))


# ``hidden_act`` names the Triton act-and-mul kernel computes, by its name for them (CUDA only).
_TRITON_ACTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU with SiLU, GeGLU with GELU."""

    def __init__(self, arch: DecoderArch, tp: TPGroup) -> None:
        super().__init__()
        hidden, inner, bias = arch.hidden_size, arch.intermediate_size, arch.mlp_bias
        self.gate_proj = _column(arch, (hidden, inner), bias, tp)
        self.up_proj = _column(arch, (hidden, inner), bias, tp)
        self.down_proj = _row(arch, (inner, hidden), bias, tp)
        self.act = activation(arch.hidden_act, "hidden_act")
        self.triton_act = _TRITON_ACTS.get(arch.hidden_act)
        self.gate_up_proj: nn.Module | None = None
        """gate and up in one GEMM, once :meth:`fuse_projections` has replaced the two."""

    def fuse_projections(self) -> None:
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        if self.gate_up_proj is not None:
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.triton_act is not None and runs_on_triton(gate):
            return self.down_proj(act_and_mul(gate, up, self.triton_act))
        if self.act is nn.functional.silu:
            return self.down_proj(silu_and_mul_cpu(gate, up))
        # NOTE: the product is taken in place in the activation's output, a tensor of this call's own.
        return self.down_proj(self.act(gate).mul_(up))


def _mlp(arch: DecoderArch, layer: int, tp: TPGroup) -> nn.Module:
    if arch.moe is None or not arch.moe_layers[layer]:
        return GatedMLP(arch, tp)
    from pagedllm.server.worker.models.moe import SparseMoeBlock

    moe = arch.moe
    sizes = (arch.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k)
    return SparseMoeBlock(*sizes, moe.norm_topk_prob, arch.hidden_act, tp, quant=arch.quant)


class DecoderLayer(nn.Module):
    def __init__(self, arch: DecoderArch, layer: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        eps, gemma = arch.rms_norm_eps, arch.family.gemma_norms
        self.self_attn = DecoderAttention(arch, layer, rotary, tp)
        self.mlp = _mlp(arch, layer, tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, gemma)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, gemma)
        self.sandwich = arch.family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, gemma)

    def forward(self, x, residual, positions, kv_cache, meta, ops):
        """(this layer's output, the residual stream), the output not yet added to the stream.

        NOTE: the next layer's input norm (or the final norm) adds it in the same pass as it
        normalises (:meth:`RMSNorm.add_and_norm`); ``residual`` is None at the first layer.
        """
        if residual is None:
            normed, residual = self.input_layernorm(x), x
        else:
            normed, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn.forward(normed, positions, kv_cache, meta, ops)  # NOTE: as in DecoderAttention.forward
        if not self.sandwich:
            normed, residual = self.post_attention_layernorm.add_and_norm(h, residual)
            return self.mlp.forward(normed), residual
        residual = residual + self.post_attention_layernorm(h)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(residual))), residual


class DecoderModel(nn.Module):
    def __init__(self, arch: DecoderArch, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        # NOTE: one rotation table per distinct RoPE setting (two at most, Gemma 3's), not one per layer.
        tables: dict[str, RotaryEmbedding] = {}
        for params in arch.layer_rope:
            key = repr(sorted(params.items()))
            if key not in tables:
                tables[key] = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, params)
        rotary = [tables[repr(sorted(params.items()))] for params in arch.layer_rope]
        self.layers = nn.ModuleList(DecoderLayer(arch, i, rotary[i], tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.family.gemma_norms)


class DecoderForCausalLM(nn.Module):
    """Token ids and positions in, final hidden states out; logits only where asked."""

    def __init__(self, arch: DecoderArch, tp: TPGroup) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.model = DecoderModel(arch, tp)
        tied = self.model.embed_tokens if arch.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(arch.hidden_size, arch.vocab_size, tp, tied=tied)
        # NOTE: Gemma multiplies embeddings by sqrt(hidden) rounded to the weights' dtype.
        self.embed_scale = arch.hidden_size**0.5 if arch.family.gemma_norms else None

    @classmethod
    def from_hf_config(cls, cfg: dict, tp: TPGroup = TPGroup()) -> DecoderForCausalLM:
        return cls(DecoderArch.from_hf(cfg), tp)

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
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer.forward(x, residual, positions, kv_cache, meta, ops)  # NOTE: no hooks on layers
        return self.model.norm(x) if residual is None else self.model.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.arch.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name (renamed and split per family); each parameter once."""
        load_decoder_weights(self, weights)
