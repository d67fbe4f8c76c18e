"""AWQ's GEMM layout: 4-bit weights packed along the output features, with zero points.

    qweight  int32 [K, N / 8]          8 output columns per word, in the order below
    qzeros   int32 [K / group, N / 8]  packed the same way
    scales   fp16  [K / group, N]
    w[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n]

AWQ stores the 8 values of a word in the order [0, 2, 4, 6, 1, 3, 5, 7]: slot i (bits
4i .. 4i+3) holds column ``AWQ_ORDER[i]`` of the word's 8 columns.
"""

from __future__ import annotations

import torch

from pagedllm.server.config.quantization import QuantConfig
from pagedllm.server.worker.quantization.base import QuantizedWeight, TensorSpec, unpack_int32

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def specs(cfg: QuantConfig, k: int, n: int, k_full: int) -> list[TensorSpec]:
    """The tensors of one [n, k] layer (this rank's shape)."""
    g = cfg.group_size
    return [
        TensorSpec("qweight", (k, n // 8), torch.int32, out_dim=1, out_unit=8, in_dim=0),
        TensorSpec("qzeros", (k // g, n // 8), torch.int32, out_dim=1, out_unit=8, in_dim=0, in_unit=g),
        TensorSpec("scales", (k // g, n), torch.float32, out_dim=1, in_dim=0, in_unit=g),
    ]


def to_weight(cfg: QuantConfig, t: dict[str, torch.Tensor]) -> QuantizedWeight:
    q = unpack_int32(t["qweight"], 4, dim=1, order=AWQ_ORDER).T.contiguous()
    zeros = unpack_int32(t["qzeros"], 4, dim=1, order=AWQ_ORDER).T.float()
    return QuantizedWeight(q, t["scales"].T.float().contiguous(), zeros.contiguous(), cfg.group_size, 4)
