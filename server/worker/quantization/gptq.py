"""GPTQ's layout: 4- or 8-bit weights packed along the input features, zero points along the output.

    qweight  int32 [K * bits / 32, N]       value k of a column at word k // per, bits (k % per) * bits
    qzeros   int32 [groups, N * bits / 32]  packed along N the same way; v1 stores zero - 1
    scales   fp16  [groups, N]
    g_idx    int32 [K]                      the group of each input feature
    w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

Without act-order ``g_idx[k] = k // group`` and is ignored; with it (``desc_act``) K is sorted
by group at load (:func:`~pagedllm.server.worker.quantization.base.sort_by_groups`). A group
size of -1 is one group per output channel.

NOTE: with act-order and row parallelism a rank's input features belong to any group, so
scales and zeros stay whole on every rank and its slice of ``g_idx`` picks from them.
"""

from __future__ import annotations

import torch

from pagedllm.server.config.quantization import QuantConfig
from pagedllm.server.worker.quantization.base import QuantizedWeight, TensorSpec, sort_by_groups, unpack_int32


def specs(cfg: QuantConfig, k: int, n: int, k_full: int) -> list[TensorSpec]:
    per = 32 // cfg.bits
    grouped = cfg.group_size > 0 and not cfg.desc_act
    g = cfg.group_size if cfg.group_size > 0 else k_full
    groups = k // g if grouped else -(-k_full // g)
    group_dim = 0 if grouped else None
    return [
        TensorSpec("qweight", (k // per, n), torch.int32, out_dim=1, in_dim=0, in_unit=per),
        TensorSpec("qzeros", (groups, n // per), torch.int32, out_dim=1, out_unit=per, in_dim=group_dim, in_unit=g),
        TensorSpec("scales", (groups, n), torch.float32, out_dim=1, in_dim=group_dim, in_unit=g),
        TensorSpec("g_idx", (k,), torch.int32, in_dim=0),
    ]


def to_weight(cfg: QuantConfig, t: dict[str, torch.Tensor]) -> QuantizedWeight:
    bits = cfg.bits
    q = unpack_int32(t["qweight"], bits, dim=0).T.contiguous()  # [N, K]
    zeros = unpack_int32(t["qzeros"], bits, dim=1)
    if cfg.zeros_minus_one:
        zeros = (zeros.int() + 1) & ((1 << bits) - 1)
    zeros, scales = zeros.T.float().contiguous(), t["scales"].T.float().contiguous()
    if cfg.desc_act:
        return sort_by_groups(q, scales, zeros, t["g_idx"], bits)
    group = cfg.group_size if cfg.group_size > 0 else q.shape[1]
    return QuantizedWeight(q, scales, zeros, group, bits)
