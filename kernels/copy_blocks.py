"""Batched block copy for copy-on-write: ``cache[dst] = cache[src]`` for every
``(src, dst)`` pair, for every layer's K and V cache.

Launches: one per layer (K and V together) in general. When all layers' caches are views
of one allocation at a constant spacing (e.g. the worker allocates one
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor and hands out
``kv[l, 0]`` / ``kv[l, 1]``), a single launch covers every layer: the kernel gets layer
0's caches and steps ``layer * layer_stride`` elements from them. No pointer arrays are
loaded from memory, so Triton's CPU interpreter runs both paths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._paged import check_kv_caches
from ._triton import check_can_launch, next_pow2, tl, triton
from .kv_quant import raw

MAX_TILE = 4096


@triton.jit
def copy_blocks_kernel(
    key_cache_ptr,  # layer 0: [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # layer 0: [num_blocks, block_size, num_kv_heads, head_dim]
    block_mapping_ptr,  # [num_pairs, 2] int64 (src, dst)
    layer_stride_k,  # elements from one layer's key cache to the next (0 with one layer)
    layer_stride_v,
    stride_kc_blk,
    stride_vc_blk,
    stride_map_pair,
    stride_map_col,
    block_numel,  # block_size * num_kv_heads * head_dim, contiguous within a block
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    src = tl.load(block_mapping_ptr + pair * stride_map_pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + pair * stride_map_pair + stride_map_col).to(tl.int64)
    k = key_cache_ptr + layer * layer_stride_k
    v = value_cache_ptr + layer * layer_stride_v
    tl.store(k + dst * stride_kc_blk + offs, tl.load(k + src * stride_kc_blk + offs, mask=mask), mask=mask)
    tl.store(v + dst * stride_vc_blk + offs, tl.load(v + src * stride_vc_blk + offs, mask=mask), mask=mask)


def _check_args(key_caches, value_caches, block_mapping) -> None:
    if len(key_caches) != len(value_caches):
        raise ValueError(f"got {len(key_caches)} key caches but {len(value_caches)} value caches")
    for layer, (k, v) in enumerate(zip(key_caches, value_caches)):
        check_kv_caches(k, v)
        if k.shape != key_caches[0].shape or k.dtype != key_caches[0].dtype:
            raise ValueError(
                f"layer {layer} cache is {k.dtype} {tuple(k.shape)}, layer 0 is "
                f"{key_caches[0].dtype} {tuple(key_caches[0].shape)}; all layers must match"
            )
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2 or block_mapping.dtype != torch.int64:
        raise ValueError(
            f"block_mapping must be int64 [num_pairs, 2], got {block_mapping.dtype} {tuple(block_mapping.shape)}"
        )


def _layer_stride(caches: Sequence[torch.Tensor]) -> int | None:
    """Constant element spacing between consecutive layers in one allocation, else None."""
    if len(caches) == 1:
        return 0
    storage = caches[0].untyped_storage().data_ptr()
    if any(c.untyped_storage().data_ptr() != storage or c.stride() != caches[0].stride() for c in caches):
        return None
    offsets = [c.storage_offset() for c in caches]
    step = int(offsets[1] - offsets[0])
    return step if all(b - a == step for a, b in zip(offsets, offsets[1:])) else None


def copy_blocks(
    key_caches: Sequence[torch.Tensor],  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    value_caches: Sequence[torch.Tensor],  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src, dst)
) -> None:
    """Copy block ``src`` to block ``dst`` in every layer's K and V cache (in place, Triton).

    NOTE: pairs are copied in parallel, so no ``dst`` may repeat or also appear as a
    ``src`` (copy-on-write destinations are freshly allocated blocks). Each cache block
    must be contiguous (``cache[b]`` contiguous); the block stride may be anything.
    One launch if all layers sit in one allocation at a constant spacing, else one per layer.
    """
    _check_args(key_caches, value_caches, block_mapping)
    if not key_caches or block_mapping.shape[0] == 0:
        return
    key_caches, value_caches = [raw(k) for k in key_caches], [raw(v) for v in value_caches]  # NOTE: bytes of fp8
    check_can_launch(copy_blocks_kernel, *key_caches, *value_caches, block_mapping)
    for layer, cache in enumerate([*key_caches, *value_caches]):
        if not cache[0].is_contiguous():
            raise ValueError(f"cache {layer} must be contiguous within a block, got strides {cache.stride()}")
    block_numel = key_caches[0][0].numel()
    tile = min(MAX_TILE, next_pow2(block_numel))
    for key_cache, value_cache, num_layers, stride_k, stride_v in launch_plan(key_caches, value_caches):
        grid = (block_mapping.shape[0], num_layers, triton.cdiv(block_numel, tile))
        copy_blocks_kernel[grid](
            key_cache,
            value_cache,
            block_mapping,
            stride_k,
            stride_v,
            key_cache.stride(0),
            value_cache.stride(0),
            block_mapping.stride(0),
            block_mapping.stride(1),
            block_numel,
            BLOCK=tile,
        )


def launch_plan(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor]) -> list[tuple]:
    """``(key_cache, value_cache, num_layers, layer_stride_k, layer_stride_v)`` per launch:
    one launch when every layer sits in one allocation at a constant spacing, else one
    per layer."""
    stride_k, stride_v = _layer_stride(key_caches), _layer_stride(value_caches)
    if stride_k is not None and stride_v is not None:
        return [(key_caches[0], value_caches[0], len(key_caches), stride_k, stride_v)]
    return [(k, v, 1, 0, 0) for k, v in zip(key_caches, value_caches)]


def copy_blocks_reference(
    key_caches: Sequence[torch.Tensor],  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    value_caches: Sequence[torch.Tensor],  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src, dst)
) -> None:
    """Plain-torch twin of :func:`copy_blocks` (same signature, in place)."""
    _check_args(key_caches, value_caches, block_mapping)
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in [*key_caches, *value_caches]:
        raw(cache)[dst] = raw(cache)[src]  # NOTE: torch copies no float8 on the CPU, their bytes it does
