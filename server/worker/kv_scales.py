"""Per-tensor FP8 KV cache scales read from a checkpoint, set on each layer's attention.

Checkpoints quantized for an FP8 KV cache ship one scale per layer for K and for V, under
the names of the tool that made them::

    model.layers.N.self_attn.k_scale / v_scale            compressed-tensors, ModelOpt
    model.layers.N.self_attn.k_proj.output_scale / v_...  older ModelOpt exports
    model.layers.N.self_attn.kv_scale                     one scale for both (older vLLM)

They are taken out of the weight stream before the model sees it (they are no parameter
of it) and set on the N-th :class:`PagedAttention` once the weights are in. Layers without
one, and every layer of a checkpoint without them, keep 1.0. An int8 cache ignores them:
its rows carry their own scales.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch

from pagedllm.kernels.kv_quant import FP8_DTYPES, KVScales
from pagedllm.server.worker.attention import PagedAttention

logger = logging.getLogger(__name__)

_SCALE_NAME = re.compile(r"\.(\d+)\..*?(k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale)$")


def split_kv_scales(weights: Iterable[tuple[str, torch.Tensor]], found: dict[int, dict[str, float]]) -> Iterator:
    """``weights`` without the KV cache scales, which go into ``found`` (layer -> ``{"k": s, "v": s}``)."""
    for name, tensor in weights:
        match = _SCALE_NAME.search(name)
        if match is None:
            yield name, tensor
            continue
        layer, kind = int(match[1]), match[2]
        value = float(tensor.float().reshape(-1).max())  # NOTE: a per-tensor scale, stored as [] or [1]
        for side in ("k", "v") if kind == "kv_scale" else (kind[0],):
            found.setdefault(layer, {})[side] = value


def apply_kv_scales(model: torch.nn.Module, found: dict[int, dict[str, float]], cache_dtype: torch.dtype) -> int:
    """Set each layer's FP8 scales from ``found``; returns how many layers got one."""
    if cache_dtype not in FP8_DTYPES or not found:
        return 0
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    for index, scales in found.items():
        if index >= len(layers):
            raise ValueError(f"the checkpoint has KV cache scales for layer {index}, the model {len(layers)} layers")
        layers[index].kv_scales = KVScales(scales.get("k", 1.0), scales.get("v", 1.0))
    logger.info("FP8 KV cache scales from the checkpoint for %d of %d layers", len(found), len(layers))
    return len(found)
