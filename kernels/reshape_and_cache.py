"""Fused KV write: scatter the new tokens' K and V into the paged caches by slot.

A slot is a flat position in the cache, ``slot = block_id * block_size + offset``::

    slot_mapping:  [ 13,  14,  -1,   5 ]        (block_size = 8, -1 = padding)
                     │    │          │
    key_cache:     block 1, offsets 5, 6     block 0, offset 5

An 8-bit cache (kv_quant.py) gets the new rows quantized inside the same launch, bit for
bit as :func:`~pagedllm.kernels.kv_quant.quantize` (the reference's torch ops, on the CPU)
rounds them: fp8 with the layer's per-tensor scale, int8 with a float16 scale per
(token, head) row stored after its values. Rows already in the cache's dtype are copied.
"""

from __future__ import annotations

import torch

from ._triton import check_can_launch, next_pow2, tl, triton
from ._triton_kv import KV_PLAIN, kv_format, store_kv_rows
from .kv_quant import QUANT_DTYPES, head_dim_of, is_quantized, quantize, raw

_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = (*_MODEL_DTYPES, torch.uint8, *QUANT_DTYPES)  # 8-bit: rows already quantized (or bytes)


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_blk,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_slot,
    stride_vc_head,
    k_scale,
    v_scale,
    num_kv_heads,
    head_dim,  # of the values; an int8 row's scale follows them
    block_size: tl.constexpr,
    KV_QUANT: tl.constexpr,  # _triton_kv's KV_PLAIN / KV_FP8 / KV_INT8
    FP8_E4M3: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # NOTE: padding slots (< 0) are masked off rather than returned from, and the block
    # id is clamped so no out-of-range address is even formed for them. The slot is
    # broadcast before the comparison because Triton's interpreter mis-types
    # `scalar_bool & tensor_bool` masks.
    safe_slot = tl.maximum(slot, 0)
    block = safe_slot // block_size
    offset = safe_slot % block_size
    row_mask = (heads < num_kv_heads) & ((tl.zeros([BLOCK_H], tl.int64) + slot) >= 0)
    mask = row_mask[:, None] & (dims[None, :] < head_dim)
    heads64 = heads.to(tl.int64)[:, None]
    src_k = key_ptr + token * stride_k_tok + heads64 * stride_k_head + dims[None, :]
    src_v = value_ptr + token * stride_v_tok + heads64 * stride_v_head + dims[None, :]
    dst_k = key_cache_ptr + block * stride_kc_blk + offset * stride_kc_slot + heads64 * stride_kc_head
    dst_v = value_cache_ptr + block * stride_vc_blk + offset * stride_vc_slot + heads64 * stride_vc_head
    store_kv_rows(dst_k, tl.load(src_k, mask=mask), dims, mask, row_mask, k_scale, head_dim, KV_QUANT, FP8_E4M3)
    store_kv_rows(dst_v, tl.load(src_v, mask=mask), dims, mask, row_mask, v_scale, head_dim, KV_QUANT, FP8_E4M3)


def _quantizes(key: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """True when ``key`` holds model values for an 8-bit cache (not rows already quantized)."""
    return is_quantized(key_cache) and key.dtype != key_cache.dtype


def _as_stored(key, value, key_cache, value_cache, k_scale: float, v_scale: float) -> tuple[torch.Tensor, ...]:
    """For an 8-bit cache: the new rows quantized by the torch ops and all four as byte views."""
    if _quantizes(key, key_cache):
        key, value = quantize(key, key_cache.dtype, k_scale), quantize(value, value_cache.dtype, v_scale)
    if not is_quantized(key_cache):
        return key, value, key_cache, value_cache
    return raw(key), raw(value), raw(key_cache), raw(value_cache)


def _check_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            "key and value must both be [num_tokens, num_kv_heads, head_dim], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    quantizes = _quantizes(key, key_cache)
    held = (key_cache.shape[2], head_dim_of(key_cache)) if quantizes else tuple(key_cache.shape[2:])
    if tuple(key.shape[1:]) != held:
        raise ValueError(
            f"key is [num_tokens, num_kv_heads, head_dim] = {tuple(key.shape)} but the cache "
            f"holds (num_kv_heads, head_dim) = {held}"
        )
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 [num_tokens={key.shape[0]}], "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    _check_dtypes(key, value, key_cache, value_cache, quantizes)


def _check_dtypes(key, value, key_cache, value_cache, quantizes: bool) -> None:
    if value_cache.dtype != key_cache.dtype or value.dtype != key.dtype:
        raise TypeError(
            f"key and value ({key.dtype}, {value.dtype}) and the caches ({key_cache.dtype}, "
            f"{value_cache.dtype}) must come in pairs of one dtype"
        )
    if quantizes and key.dtype not in _MODEL_DTYPES:
        raise TypeError(f"key has dtype {key.dtype}; an 8-bit cache quantizes one of {_MODEL_DTYPES}")
    if not quantizes and (key.dtype != key_cache.dtype or key.dtype not in _FLOAT_DTYPES):
        raise TypeError(
            f"key has dtype {key.dtype}; key, value and the caches must share one of "
            f"{_FLOAT_DTYPES}, the caches are {key_cache.dtype}"
        )


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` into the caches at ``slot_mapping`` (in place, one launch).

    ``slot = block_id * block_size + offset``; a slot < 0 marks a padding token, which is
    skipped. ``key``/``value`` may be strided views (e.g. slices of a fused QKV output)
    as long as ``head_dim`` is contiguous; the caches need a contiguous ``head_dim`` too.
    An 8-bit cache stores them quantized (``k_scale``/``v_scale``: an fp8 cache's scales).
    """
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    fmt = kv_format(key_cache) if _quantizes(key, key_cache) else KV_PLAIN
    fp8_e4m3 = key_cache.dtype == torch.float8_e4m3fn
    key, value = (raw(key), raw(value)) if fmt == KV_PLAIN else (key, value)
    key_cache, value_cache = raw(key_cache), raw(value_cache)
    check_can_launch(reshape_and_cache_kernel, key, value, key_cache, value_cache, slot_mapping)
    tensors = (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slot_mapping", slot_mapping),
    )
    for name, t in tensors:
        if t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_kv_heads), max(1, 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    reshape_and_cache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        k_scale,
        v_scale,
        num_kv_heads,
        head_dim,
        block_size=key_cache.shape[1],
        KV_QUANT=fmt,
        FP8_E4M3=fp8_e4m3,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )


def reshape_and_cache_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain-torch twin of :func:`reshape_and_cache` (same signature, in place): an 8-bit
    cache's rows quantized by :func:`~pagedllm.kernels.kv_quant.quantize`, then scattered."""
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    key, value, key_cache, value_cache = _as_stored(key, value, key_cache, value_cache, k_scale, v_scale)
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[valid]  # [num_valid]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[valid]
    value_cache[blocks, offsets] = value[valid]
