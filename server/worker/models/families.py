"""Checkpoint names per family, mapped onto the decoder's (Hugging Face LLaMA-style) parameter names.

Most families already use LLaMA's names. The others differ only in how tensors are cut::

    phi3      self_attn.qkv_proj   [q | k | v] rows   -> q_proj, k_proj, v_proj
              mlp.gate_up_proj     [gate | up] rows   -> gate_proj, up_proj
    mixtral   block_sparse_moe.gate                   -> mlp.gate
              block_sparse_moe.experts.E.w1 / w3 / w2 -> mlp.experts.E.gate_proj / up_proj / down_proj

Mixture-of-experts blocks take their own tensors (``load_checkpoint_tensor``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.server.worker.models.checkpoint import copy_weights

if TYPE_CHECKING:
    from pagedllm.server.worker.models.decoder import DecoderForCausalLM
    from pagedllm.server.worker.models.decoder_arch import DecoderArch

Weights = Iterable[tuple[str, torch.Tensor]]

_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def load_decoder_weights(model: DecoderForCausalLM, weights: Weights) -> None:
    """Rename, split and copy a checkpoint into ``model``; every parameter must be filled once."""
    arch = model.arch
    delegates: dict[str, Any] = {
        f"model.layers.{i}.mlp.": layer.mlp for i, layer in enumerate(model.model.layers) if arch.moe_layers[i]
    }
    copy_weights(model, canonical_weights(arch, weights), arch.model_type, delegates)


def canonical_weights(arch: DecoderArch, weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under the decoder's names, without those it does not keep."""
    for name, tensor in weights:
        if "rotary_emb" in name or (arch.tie_word_embeddings and name == "lm_head.weight"):
            continue
        if arch.model_type == "mixtral":
            name = _MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m[1]}.{_MIXTRAL_PROJ[m[2]]}.", name)
            name = name.replace(".block_sparse_moe.", ".mlp.")
        if name.endswith(".self_attn.qkv_proj.weight"):
            yield from _split_rows(name, "qkv_proj", tensor, _qkv_rows(arch), ("q_proj", "k_proj", "v_proj"))
        elif name.endswith(".mlp.gate_up_proj.weight"):
            half = tensor.shape[0] // 2
            yield from _split_rows(name, "gate_up_proj", tensor, [half, half], ("gate_proj", "up_proj"))
        else:
            yield name, tensor


def _qkv_rows(arch: DecoderArch) -> list[int]:
    return [arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim]


def _split_rows(name: str, fused: str, tensor: torch.Tensor, rows: list[int], parts: tuple[str, ...]):
    if tensor.shape[0] != sum(rows):
        raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected {sum(rows)} ({rows})")
    for part, piece in zip(parts, torch.split(tensor, rows, dim=0)):
        yield name.replace(f".{fused}.", f".{part}."), piece
