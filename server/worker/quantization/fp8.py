"""Block-wise fp8 checkpoints (``quant_method: fp8``, as Qwen3-FP8 and DeepSeek ship) and online quantization.

fp8-block    weight float8_e4m3fn [N, K], weight_scale_inv float32 [N / 128, K / 128]
             w = weight * scale_inv of its 128 x 128 block
online-fp8   a plain checkpoint; at load each output channel becomes fp8 e4m3 with one scale
online-int8  likewise, int8 with scale amax / 127 (symmetric)
"""

from __future__ import annotations

import torch

from pagedllm.server.config import ConfigError
from pagedllm.server.config.quantization import QuantConfig
from pagedllm.server.worker.quantization.base import QuantizedWeight, TensorSpec

FP8_MAX = 448.0


def specs(cfg: QuantConfig, k: int, n: int, k_full: int) -> list[TensorSpec]:
    if cfg.format != "fp8-block":
        return [TensorSpec("weight", (n, k), torch.get_default_dtype(), out_dim=0, in_dim=1)]
    assert cfg.block is not None
    bn, bk = cfg.block
    if k % bk:
        raise ConfigError("quantization_config.weight_block_size", list(cfg.block), f"blocks that divide K={k}")
    return [
        TensorSpec("weight", (n, k), torch.float8_e4m3fn, out_dim=0, in_dim=1),
        TensorSpec("weight_scale_inv", (-(-n // bn), k // bk), torch.float32, 0, bn, 1, bk),
    ]


def to_weight(cfg: QuantConfig, t: dict[str, torch.Tensor]) -> QuantizedWeight:
    if cfg.format == "fp8-block":
        assert cfg.block is not None
        n = t["weight"].shape[0]
        scales = t["weight_scale_inv"].float().repeat_interleave(cfg.block[0], dim=0)[:n]
        return QuantizedWeight(t["weight"], scales.contiguous(), None, cfg.block[1], 8)
    return quantize_per_channel(t["weight"], cfg.format)


def quantize_per_channel(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """``w`` [N, K] as int8 (``online-int8``) or fp8 e4m3 (``online-fp8``) with one scale per output channel."""
    w = w.float()
    top = FP8_MAX if fmt == "online-fp8" else 127.0
    scales = (w.abs().amax(dim=1, keepdim=True) / top).clamp(min=1e-12)
    if fmt == "online-fp8":
        q = (w / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        q = torch.round(w / scales).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(q, scales, None, w.shape[1], 8)
