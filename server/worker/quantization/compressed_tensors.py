"""compressed-tensors (what llm-compressor writes): packed int weights, int8 and fp8 W8A8.

pack-quantized  weight_packed      int32 [N, K * bits / 32]  signed values + 2**(bits-1), sequential along K
                weight_scale       [N, groups]
                weight_zero_point  int32 [N * bits / 32, groups]  (asymmetric only; packed along N)
                weight_shape       int [2]
int8 W8A8       weight int8 [N, K], weight_scale [N, 1]  (activations: dynamic per token)
fp8 W8A8        weight float8_e4m3fn [N, K], weight_scale [N, 1] or [1]
"""

from __future__ import annotations

import torch

from pagedllm.server.config.quantization import QuantConfig
from pagedllm.server.worker.quantization.base import QuantizedWeight, TensorSpec, unpack_int32


def specs(cfg: QuantConfig, k: int, n: int, k_full: int) -> list[TensorSpec]:
    if cfg.format != "pack-quantized":
        dtype = torch.int8 if cfg.format == "int8-w8a8" else torch.float8_e4m3fn
        scale = TensorSpec("weight_scale", (1,), torch.float32) if cfg.per_tensor else _channel_scale(n)
        return [TensorSpec("weight", (n, k), dtype, out_dim=0, in_dim=1), scale]
    per = 32 // cfg.bits
    grouped = cfg.group_size > 0
    g = cfg.group_size if grouped else k_full
    groups, group_dim = (k // g, 1) if grouped else (1, None)
    tensors = [
        TensorSpec("weight_packed", (n, k // per), torch.int32, out_dim=0, in_dim=1, in_unit=per),
        TensorSpec("weight_scale", (n, groups), torch.float32, out_dim=0, in_dim=group_dim, in_unit=g),
        TensorSpec("weight_shape", (2,), torch.int64),
    ]
    if not cfg.sym:
        zp = TensorSpec("weight_zero_point", (n // per, groups), torch.int32, 0, per, group_dim, g)
        tensors.append(zp)
    return tensors


def _channel_scale(n: int) -> TensorSpec:
    return TensorSpec("weight_scale", (n, 1), torch.float32, out_dim=0)


def to_weight(cfg: QuantConfig, t: dict[str, torch.Tensor]) -> QuantizedWeight:
    if cfg.format != "pack-quantized":
        n, k = t["weight"].shape
        scales = t["weight_scale"].float().reshape(-1, 1).expand(n, 1).contiguous()
        return QuantizedWeight(t["weight"], scales, None, k, cfg.bits, int8_activations=cfg.format == "int8-w8a8")
    q = unpack_int32(t["weight_packed"], cfg.bits, dim=1)
    n, k = q.shape
    scales = t["weight_scale"].float()
    if cfg.sym:
        zeros = torch.full_like(scales, float(1 << (cfg.bits - 1)))
    else:
        zeros = unpack_int32(t["weight_zero_point"], cfg.bits, dim=0)[:n].float()
    group = cfg.group_size if cfg.group_size > 0 else k
    return QuantizedWeight(q, scales, zeros.contiguous(), group, cfg.bits)
