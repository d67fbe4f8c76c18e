"""What every quantized format hands the kernels: integer levels, group scales and zero points.

Each format module describes the tensors a layer of it keeps in a checkpoint
(:class:`TensorSpec`: shape, dtype, and which dimension runs along the output and input
features, so tensor parallelism can cut them) and turns them, once loaded, into one
:class:`QuantizedWeight`. Kernels are built from that alone::

    checkpoint (awq | gptq | compressed-tensors | fp8 | bf16 for online)
        └─ format.to_weight(tensors) ─► QuantizedWeight  q [N, K], scales/zeros [N, K / group]
                                              └─ choose_kernel ─► packed int4 (CPU), int8, Triton, dequantize

    w[n, k] = (q[n, k] - zeros[n, k // group]) * scales[n, k // group]

NOTE: act-order (GPTQ ``desc_act``) groups input features by ``g_idx``, not by position.
The loader sorts K by group once (:func:`sort_by_groups`); the layer then multiplies
``x[:, perm]``, so every kernel sees contiguous equal groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor of a quantized layer, as this rank keeps it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dim: int | None = None
    """The dimension along the output features (cut by column parallelism), if any."""
    out_unit: int = 1
    """Output features per element along ``out_dim`` (values packed in one int32)."""
    in_dim: int | None = None
    """The dimension along the input features (cut by row parallelism), if any."""
    in_unit: int = 1
    """Input features per element along ``in_dim`` (packed values, or a group's size)."""


@dataclass
class QuantizedWeight:
    """A quantized [N, K] weight in one layout every kernel starts from."""

    q: torch.Tensor
    """[N, K] levels: uint8 (unsigned ints), int8 (signed, zero 0) or float8 (fp8 formats)."""
    scales: torch.Tensor
    """[N, K // group_size] float32."""
    zeros: torch.Tensor | None
    """[N, K // group_size] float32 zero levels, or None (zero is 0)."""
    group_size: int
    bits: int
    perm: torch.Tensor | None = None
    """[K] int64: the layer multiplies ``x[:, perm]`` (act-order), or None."""
    int8_activations: bool = False
    """The format quantizes activations to int8 per token as it runs (W8A8), not only weights."""

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in ``dtype`` (in the permuted input order when ``perm`` is set)."""
        g = self.group_size
        w = self.q.to(torch.float32)
        if self.zeros is not None:
            w = w - self.zeros.repeat_interleave(g, dim=1)
        return (w * self.scales.repeat_interleave(g, dim=1)).to(dtype)


def concat_weights(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """The weights stacked along N (fused q/k/v, gate/up), or None where they cannot share one input."""
    first = parts[0]
    if any(p.perm is not None for p in parts) or any(p.group_size != first.group_size for p in parts):
        return None
    if any((p.zeros is None) != (first.zeros is None) or p.q.dtype != first.q.dtype for p in parts):
        return None
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])  # type: ignore[misc]
    scales = torch.cat([p.scales for p in parts])
    q = torch.cat([p.q for p in parts])
    return QuantizedWeight(q, scales, zeros, first.group_size, first.bits, None, first.int8_activations)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """Values packed ``32 // bits`` per int32 along ``dim``, as uint8 (value i at bits ``i * bits``).

    ``order[i]`` is the position (within its word's run) of the value stored at slot i; sequential if None.
    """
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    x = packed.movedim(dim, -1).unsqueeze(-1) >> shifts  # [..., words, per]
    x = (x & ((1 << bits) - 1)).to(torch.uint8)
    if order is not None:
        inverse = [order.index(i) for i in range(per)]
        x = x[..., inverse]
    return x.flatten(-2).movedim(-1, dim).contiguous()


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``values`` packed ``32 // bits`` per int32 along ``dim``, sequentially (inverse of unpack)."""
    per = 32 // bits
    x = values.movedim(dim, -1).to(torch.int32)
    x = x.reshape(*x.shape[:-1], -1, per) << torch.arange(0, 32, bits, dtype=torch.int32, device=x.device)
    return x.sum(-1, dtype=torch.int32).movedim(-1, dim).contiguous()


def sort_by_groups(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, g_idx: torch.Tensor, bits: int
) -> QuantizedWeight:
    """Act-order weight (q [N, K], scales/zeros [N, groups], g_idx [K]) with K sorted into equal groups.

    Groups that are not all the same size after sorting (a shard cut through them) fall back
    to one scale per input feature (group size 1): exact, only larger.
    """
    g_idx = g_idx.long()
    perm = torch.argsort(g_idx, stable=True)
    ids = g_idx[perm]
    unique, counts = torch.unique_consecutive(ids, return_counts=True)
    q = q[:, perm]
    if bool((counts == counts[0]).all()):
        group, take = int(counts[0]), unique
    else:
        group, take = 1, ids
    zeros = zeros[:, take] if zeros is not None else None
    identity = bool((perm == torch.arange(perm.numel(), device=perm.device)).all())
    return QuantizedWeight(q, scales[:, take].float(), zeros, group, bits, None if identity else perm)
