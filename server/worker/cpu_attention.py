"""Paged attention in plain torch ops, planned once per step for the CPU.

The kernels' ``*_reference`` functions stay the oracle; this is what the engine runs when
the attention backend is ``torch``. Decode reads each sequence's blocks once, with
sequences of similar length batched together so that padding stays small::

    decodes sorted by number of blocks:  2 2 3 | 9 9 10 10 | 31
    group 0: gather 3 blocks for 3 rows   -> SDPA, positions past a context masked
    group 1: gather 10 blocks for 4 rows  -> SDPA
    group 2: gather 31 blocks for 1 row   -> SDPA

(the reference pads every sequence to the longest and zero-fills the padding: most of
its time is that gather). The grouping and the flattened block indices depend only on
the step, so they are built once (:func:`plan_attention`) and shared by every layer.
The ``numba`` backend skips all of that for decode: its compiled kernel
(kernels/paged_decode_attention_cpu.py) reads the blocks in place through the tables.

Prefill chunks with no cached prefix attend to their own new K/V directly (causal SDPA);
others read their whole context from the cache.

NOTE: positions past a context inside a gathered block are masked, not zeroed. Their
probabilities are exactly 0, which is enough because the cache only ever holds finite
values: it is allocated with zeros and written with the model's K/V (copies and swaps
move whole blocks of such values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.kernels.paged_decode_attention_cpu import paged_decode_attention_cpu

# NOTE: measured on a 2-core CPU (benchmarks/cpu_attention.py): merging sequences whose
# lengths differ by up to this many tokens (or 1/8 of the shorter) costs less padding work
# than the per-group gather and SDPA calls it saves.
MAX_PAD_TOKENS = 32


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows ``rows`` (of the length-sorted batch) that share one gather and one SDPA."""

    rows: slice
    block_index: torch.Tensor  # [num_rows * num_blocks] int64: physical blocks, row-major
    mask: torch.Tensor | None  # [num_rows, 1, 1, length] bool: inside the context; None if all full
    length: int  # num_blocks * block_size


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's new tokens: rows ``start:end`` of the prefill part of the step."""

    start: int
    end: int
    context_len: int  # including the new tokens
    block_table: torch.Tensor  # [max_blocks] int32


@dataclass(frozen=True)
class CompiledDecode:
    """The decode rows as the compiled kernel reads them: straight through the block tables."""

    block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    context_lens: torch.Tensor  # [num_decodes] int32


@dataclass(frozen=True)
class AttentionPlan:
    """What every layer's attention reuses within one step."""

    order: torch.Tensor | None  # [num_decodes] int64: decode rows by length; None when already sorted
    groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    compiled: CompiledDecode | None = None
    """Set when decode runs the compiled kernel (then ``order`` is None and ``groups`` empty)."""


def plan_attention(
    decode_block_tables: torch.Tensor,  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor,  # [num_decodes] int32
    prefill_block_tables: torch.Tensor,  # [num_prefills, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor,  # [num_prefills + 1] int32
    prefill_context_lens: torch.Tensor,  # [num_prefills] int32
    block_size: int,
    max_pad_tokens: int = MAX_PAD_TOKENS,
    compiled_decode: bool = False,
) -> AttentionPlan:
    """Decode groups (padding per row at most ``max_pad_tokens``, or 1/8 of the shortest) and
    prefill chunks; with ``compiled_decode`` the decode rows are left whole for the compiled kernel."""
    cu, lens = prefill_cu_seqlens_q.tolist(), prefill_context_lens.tolist()
    prefills = [
        PrefillChunk(cu[s], cu[s + 1], length, prefill_block_tables[s])
        for s, length in enumerate(lens)
        if cu[s + 1] > cu[s]
    ]
    if compiled_decode:
        compiled = CompiledDecode(decode_block_tables.contiguous(), decode_context_lens.contiguous())
        return AttentionPlan(None, [], prefills, compiled)
    order, groups = _plan_decodes(decode_block_tables, decode_context_lens.tolist(), block_size, max_pad_tokens)
    return AttentionPlan(order, groups, prefills)


def _plan_decodes(
    tables: torch.Tensor, lens: list[int], block_size: int, max_pad_tokens: int
) -> tuple[torch.Tensor | None, list[DecodeGroup]]:
    num_blocks = [-(-n // block_size) for n in lens]
    order = sorted(range(len(lens)), key=num_blocks.__getitem__)
    is_sorted = order == list(range(len(lens)))
    device = tables.device
    index = None if is_sorted else torch.tensor(order, dtype=torch.int64, device=device)
    sorted_tables = tables if index is None else tables.index_select(0, index)
    sorted_lens = [lens[i] for i in order]
    groups = []
    for start, end in _group_bounds([num_blocks[i] for i in order], block_size, max_pad_tokens):
        groups.append(_decode_group(sorted_tables[start:end], sorted_lens[start:end], start, end, block_size))
    return index, groups


def _group_bounds(sorted_blocks: list[int], block_size: int, max_pad_tokens: int) -> list[tuple[int, int]]:
    """Split a sorted list of block counts into runs whose padding stays small."""
    bounds, start = [], 0
    for i in range(1, len(sorted_blocks) + 1):
        if i < len(sorted_blocks):
            first = sorted_blocks[start] * block_size
            pad = (sorted_blocks[i] - sorted_blocks[start]) * block_size
            if pad <= max(max_pad_tokens, first // 8):
                continue
        bounds.append((start, i))
        start = i
    return bounds


def _decode_group(tables: torch.Tensor, lens: list[int], start: int, end: int, block_size: int) -> DecodeGroup:
    # tables: [rows, max_blocks] int32, sorted by length
    num_blocks = -(-max(lens) // block_size)
    length = num_blocks * block_size
    device = tables.device
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    blocks = tables[:, :num_blocks].long()  # [rows, num_blocks]
    # NOTE: table entries past a row's last block may hold anything: read its first block instead.
    needed = torch.arange(num_blocks, device=device) * block_size < lens_t[:, None]
    blocks = torch.where(needed, blocks, blocks[:, :1])
    mask = None
    if min(lens) < length:
        mask = (torch.arange(length, device=device) < lens_t[:, None])[:, None, None, :]
    return DecodeGroup(slice(start, end), blocks.reshape(-1), mask, length)


def decode_attention(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
    """Each decode's query over its cached context, one gather + SDPA per group of rows."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    q = query if plan.order is None else query.index_select(0, plan.order)
    # The query heads of one KV head act as a query sequence of length `group` (GQA
    # without repeating K/V): q [rows, kv_heads, group, d] x k, v [rows, kv_heads, length, d]
    q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.empty_like(q)
    for g in plan.groups:
        rows = g.rows.stop - g.rows.start
        keys = key_cache.index_select(0, g.block_index).view(rows, g.length, num_kv_heads, head_dim)
        values = value_cache.index_select(0, g.block_index).view(rows, g.length, num_kv_heads, head_dim)
        out[g.rows] = F.scaled_dot_product_attention(
            q[g.rows], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=g.mask, scale=scale
        )
    out = out.view(num_seqs, num_heads, head_dim)
    return out if plan.order is None else torch.empty_like(out).index_copy_(0, plan.order, out)


def compiled_decode_attention(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim] float32
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] float32
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] float32
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
    """Decode through the compiled CPU kernel, which reads the cache in place (no gather)."""
    assert plan.compiled is not None, "the plan was made with compiled_decode=True"
    decode = plan.compiled
    return paged_decode_attention_cpu(query, key_cache, value_cache, decode.block_tables, decode.context_lens, scale)


def prefill_attention(
    query: torch.Tensor,  # [total_q, num_heads, head_dim]
    key: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    value: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:  # [total_q, num_heads, head_dim]
    """Causal attention of each chunk's new tokens over its whole context."""
    out = torch.zeros_like(query)
    gqa = query.shape[1] != key_cache.shape[2]
    for chunk in plan.prefills:
        q = query[chunk.start : chunk.end].transpose(0, 1)  # [num_heads, q_len, head_dim]
        q_len = chunk.end - chunk.start
        if chunk.context_len == q_len:  # no prefix: the new K/V is the whole context
            keys, values = key[chunk.start : chunk.end], value[chunk.start : chunk.end]
            mask, causal = None, True
        else:
            keys = _gather(key_cache, chunk.block_table, chunk.context_len)
            values = _gather(value_cache, chunk.block_table, chunk.context_len)
            mask, causal = _offset_causal_mask(q_len, chunk.context_len, query.device), False
        o = F.scaled_dot_product_attention(
            q, keys.transpose(0, 1), values.transpose(0, 1), mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )  # [num_heads, q_len, head_dim]
        out[chunk.start : chunk.end] = o.transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    # -> [length, num_kv_heads, head_dim]
    num_blocks = -(-length // cache.shape[1])
    return cache.index_select(0, block_table[:num_blocks].long()).flatten(0, 1)[:length]


def _offset_causal_mask(q_len: int, length: int, device: torch.device) -> torch.Tensor:
    # [q_len, length] bool: new token i sits at position length - q_len + i
    q_pos = torch.arange(length - q_len, length, device=device)
    return torch.arange(length, device=device)[None, :] <= q_pos[:, None]


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, every slot >= 0
) -> None:
    """``reshape_and_cache`` for the engine's own steps, whose slots are never negative."""
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)
