"""The numbers and switches of a decoder-only transformer, read from a Hugging Face config.

One decoder (decoder.py) runs every family listed in :data:`FAMILIES`; what differs between
them is data, not code::

    family      attention                          MLP          norms              extras
    llama       (bias per config)                  SwiGLU       RMSNorm w*x        -
    mistral     sliding window (all layers)        SwiGLU       RMSNorm w*x        -
    qwen2       q/k/v bias, windows per layer      SwiGLU       RMSNorm w*x        -
    qwen3       q/k RMSNorm per head               SwiGLU       RMSNorm w*x        -
    phi3        fused qkv in the checkpoint        fused gate/up RMSNorm w*x       LongRoPE
    gemma       -                                  GeGLU        (1+w)              scaled embeddings
    gemma2      local/global layers, soft-capping  GeGLU        (1+w), sandwich    scaled embeddings, capped logits
    gemma3      local/global, q/k (1+w) norm       GeGLU        (1+w), sandwich    RoPE per layer type
    mixtral     sliding window                     sparse MoE   RMSNorm w*x        -
    qwen3_moe   q/k RMSNorm per head               sparse MoE   RMSNorm w*x        -

The config is expected in the form transformers normalises it to (``layer_types``,
``rope_parameters``; see ``model_loader.read_hf_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.server.config.quantization import QuantConfig, quant_config_from_hf
from pagedllm.server.worker.models.checkpoint import require
from pagedllm.server.worker.models.rope import rope_parameters_for


@dataclass(frozen=True)
class Family:
    """What a model family does differently from LLaMA."""

    qkv_bias: bool | None = None
    """Bias on the q/k/v projections: True or False for the family, None to read ``attention_bias``."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before the rotation (Qwen3, Gemma 3)."""
    gemma_norms: bool = False
    """Norms scale by ``1 + w`` in float32; embeddings are scaled by sqrt(hidden)."""
    sandwich_norms: bool = False
    """Four norms per layer: after attention and around the MLP (Gemma 2 and 3)."""
    act_key: str = "hidden_act"
    """The config entry that names the MLP activation."""
    moe: bool = False
    """The MLP of (some) layers is a sparse mixture of experts."""


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "phi3": Family(),
    "gemma": Family(gemma_norms=True),
    "gemma2": Family(gemma_norms=True, sandwich_norms=True, act_key="hidden_activation"),
    "gemma3_text": Family(qk_norm=True, gemma_norms=True, sandwich_norms=True, act_key="hidden_activation"),
    "mixtral": Family(moe=True),
    "qwen3_moe": Family(qk_norm=True, moe=True),
}


@dataclass(frozen=True)
class MoEArch:
    """A sparse mixture-of-experts MLP: ``top_k`` of ``num_experts`` experts per token."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool


@dataclass(frozen=True)
class DecoderArch:
    """Everything the decoder needs to know, read once from a Hugging Face config."""

    model_type: str
    family: Family
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
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    hidden_act: str
    attn_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    layer_windows: tuple[int | None, ...]
    """Per layer: the sliding window (keys at most this many positions back, itself included), or None."""
    layer_rope: tuple[dict, ...]
    """Per layer: the RoPE parameters of its layer type."""
    moe: MoEArch | None
    moe_layers: tuple[bool, ...]
    """Per layer: whether its MLP is the mixture of experts."""
    quant: QuantConfig | None = None
    """How the projections' weights are quantized (None: plain weights)."""

    @classmethod
    def from_hf(cls, cfg: dict) -> DecoderArch:
        model_type = cfg.get("model_type") or "llama"
        if model_type not in FAMILIES:
            raise ValueError(f"model_type={model_type!r} is not supported: choose one of {sorted(FAMILIES)}")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True is not supported: only causal decoders are served")
        family = FAMILIES[model_type]
        heads = require(cfg, "num_attention_heads")
        hidden = require(cfg, "hidden_size")
        head_dim = cfg.get("head_dim") or hidden // heads
        num_layers = require(cfg, "num_hidden_layers")
        types = layer_types(cfg, num_layers)
        moe = _moe_arch(cfg) if family.moe else None
        quant = quant_config_from_hf(cfg)
        return cls(
            model_type=model_type,
            family=family,
            vocab_size=require(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size") or 4 * hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias if family.qkv_bias is not None else bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)) and model_type not in ("qwen2",),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=cfg.get(family.act_key) or cfg.get("hidden_act") or "silu",
            attn_scale=(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            attn_softcap=cfg.get("attn_logit_softcapping"),
            final_softcap=cfg.get("final_logit_softcapping"),
            layer_windows=tuple(cfg.get("sliding_window") if t == "sliding_attention" else None for t in types),
            layer_rope=tuple(rope_parameters_for(cfg, t) for t in types),
            moe=moe,
            moe_layers=tuple(_is_moe_layer(cfg, i) if moe else False for i in range(num_layers)),
            quant=quant,
        )


def layer_types(cfg: dict, num_layers: int) -> list[str]:
    """``sliding_attention`` or ``full_attention`` per layer.

    ``layer_types`` when the config has it; otherwise a set ``sliding_window`` applies to
    every layer (Mistral, Mixtral, Phi-3), unless ``use_sliding_window`` is false (Qwen2).
    """
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
            raise ValueError(
                f"layer_types={types!r} is not supported: one of 'sliding_attention' or 'full_attention' per layer"
            )
        return list(types)
    sliding = cfg.get("sliding_window") and cfg.get("use_sliding_window", True)
    return ["sliding_attention" if sliding else "full_attention"] * num_layers


def _moe_arch(cfg: dict) -> MoEArch:
    experts = require(cfg, "num_local_experts", "num_experts")
    inner = cfg.get("moe_intermediate_size") or require(cfg, "intermediate_size")
    # NOTE: Mixtral always renormalises the chosen experts' weights; Qwen3-MoE says so in its config.
    norm = cfg.get("norm_topk_prob", True) if cfg.get("model_type") != "mixtral" else True
    return MoEArch(experts, require(cfg, "num_experts_per_tok"), inner, bool(norm))


def _is_moe_layer(cfg: dict, index: int) -> bool:
    """Qwen3-MoE can keep plain MLPs in some layers (``mlp_only_layers``, ``decoder_sparse_step``)."""
    if index in (cfg.get("mlp_only_layers") or []):
        return False
    step = cfg.get("decoder_sparse_step") or 1
    return (index + 1) % step == 0
