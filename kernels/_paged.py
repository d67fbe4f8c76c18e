"""Argument checks and cache gathering shared by the paged attention ops.

Block-table arithmetic, for ``block_size = 4``::

    block_tables[s] = [ 7, 2, 9, ... ]          (logical block -> physical block)
    token position p  ->  block_tables[s][p // 4], slot p % 4
    positions 0..3 live in block 7, 4..7 in block 2, 8..11 in block 9, ...

Sliding-window attention: a query at position ``q`` sees key ``k`` iff
``q - window < k <= q``. Reading starts at the block of the first visible key, so
table entries before it are never read (the block manager may have freed them)::

    window = 6, query at position 10:  keys 5..10 are visible
    block_tables[s] = [ x, 2, 9, ... ]   block 0 (positions 0..3) is not read: x may be stale

Logit soft-capping replaces each scaled score ``s`` by ``cap * tanh(s / cap)`` before
masking and softmax.
"""

from __future__ import annotations

import torch

from .kv_quant import QUANT_DTYPES, dequantize, head_dim_of, is_quantized, raw

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK_SIZE = 256


def check_kv_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Caches must be ``[num_blocks, block_size, num_kv_heads, head_dim]``, one float or 8-bit
    dtype (kv_quant.py: an int8 row is ``head_dim + 2`` wide)."""
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    allowed = (*FLOAT_DTYPES, *QUANT_DTYPES)
    if key_cache.dtype not in allowed or value_cache.dtype != key_cache.dtype:
        raise TypeError(f"caches must share one dtype of {allowed}, got {key_cache.dtype} and {value_cache.dtype}")
    block_size = key_cache.shape[1]
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")


def check_window(sliding_window: int | None, logit_softcap: float | None) -> None:
    """``sliding_window`` is None (off) or a positive number of positions; ``logit_softcap`` None or > 0."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)):
        raise TypeError(f"sliding_window must be an int or None, got {sliding_window!r}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (or None for no window), got {sliding_window}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be > 0 (or None for no capping), got {logit_softcap}")


def window_start(context_len: int, sliding_window: int | None) -> int:
    """The first position a query at ``context_len - 1`` sees."""
    return 0 if sliding_window is None else max(0, context_len - sliding_window)


def soft_cap(scores: torch.Tensor, logit_softcap: float | None) -> torch.Tensor:
    """``cap * tanh(scores / cap)``, or ``scores`` unchanged when capping is off."""
    return scores if logit_softcap is None else torch.tanh(scores / logit_softcap) * logit_softcap


def check_query(query: torch.Tensor, key_cache: torch.Tensor, name: str = "query") -> int:
    """``query`` is ``[tokens, num_heads, head_dim]`` in the cache dtype (any float dtype over a
    quantized cache); returns the GQA group size."""
    num_kv_heads, head_dim = key_cache.shape[2], head_dim_of(key_cache)
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"{name} must be [tokens, num_heads, head_dim={head_dim}], got {tuple(query.shape)}")
    if query.shape[1] % num_kv_heads != 0:
        raise ValueError(f"num_heads ({query.shape[1]}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.dtype != key_cache.dtype and not (is_quantized(key_cache) and query.dtype in FLOAT_DTYPES):
        raise TypeError(f"{name} dtype {query.dtype} differs from the cache dtype {key_cache.dtype}")
    return query.shape[1] // num_kv_heads


def check_int_vector(t: torch.Tensor, name: str, length: int, dtype: torch.dtype = torch.int32) -> None:
    if t.shape != (length,) or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} [{length}], got {t.dtype} {tuple(t.shape)}")


def check_block_tables(block_tables: torch.Tensor, num_seqs: int) -> None:
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [num_seqs={num_seqs}, max_blocks], "
            f"got {block_tables.dtype} {tuple(block_tables.shape)}"
        )


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """Triton kernels index ``head_dim`` (and table columns) with unit stride."""
    for name, t in tensors.items():
        if t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_tile(name: str, size: int) -> None:
    """Tile sizes are powers of two >= 16 (tl.dot's smallest reduction dimension)."""
    if size < 16 or size & (size - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {size}")


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``cache[blocks]`` in float32 (``[len(blocks), block_size, num_kv_heads, head_dim]``),
    a quantized cache's rows dequantized with its per-tensor ``scale``."""
    rows = raw(cache).index_select(0, blocks).view(cache.dtype)
    return dequantize(rows, torch.float32, scale)


def gather_sequence_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32
    length: int,
    first_block: int = 0,
    scale: float = 1.0,
) -> torch.Tensor:  # [length - first_block * block_size, num_kv_heads, head_dim]
    """Cached positions ``first_block * block_size .. length - 1`` of one sequence, contiguous
    (table entries before ``first_block`` are not read); a quantized cache's rows come back
    dequantized (``scale``: its per-tensor scale) in float32."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = raw(cache)[block_table[first_block:num_blocks].long()].view(
        cache.dtype
    )  # [blocks, block_size, kv_heads, row]
    rows = blocks.flatten(0, 1)[: length - first_block * block_size]
    return dequantize(rows, torch.float32, scale) if is_quantized(cache) else rows
