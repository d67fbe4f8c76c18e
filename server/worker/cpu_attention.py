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
the step and the layer's sliding window, so they are built once per window
(:meth:`AttentionPlan.grouped`) and shared by every layer with that window. With a
window a row gathers only its visible blocks, from the block of ``len - window`` on::

    window 20, block_size 8, len 45: positions 25..44 visible -> blocks 3, 4, 5 gathered
    (block 3 holds 24..31: position 24 is masked; blocks 0..2 are never read)

The ``numba`` backend skips all of that for decode: its compiled kernel
(kernels/paged_decode_attention_cpu.py) reads the blocks in place through the tables.

Prefill chunks with a bfloat16 query, over a bfloat16 or 8-bit cache, go to a C
flash-attention kernel that reads the cache through the block tables
(kernels/prefill_attention_cpu.py). Otherwise chunks with no cached prefix attend to their
own new K/V directly (causal SDPA); others read their context from the cache, from the
block of the first new token's first visible position on. Logit soft-capping (which SDPA
cannot do) runs the same steps with explicit scores.

An 8-bit cache (kernels/kv_quant.py) is written quantized and read back as it is used: the C
kernel widens it in place; SDPA gets the blocks gathered and dequantized to the query's dtype.
NOTE: on SDPA a chunk without a cached prefix attends to its own K/V as computed, before
quantization; the C kernel reads every chunk's K/V from the cache, as decode and later
chunks see it (as the Triton kernels do on CUDA).

NOTE: positions past a context inside a gathered block are masked, not zeroed. Their
probabilities are exactly 0, which is enough because the cache only ever holds finite
values: it is allocated with zeros and written with the model's K/V (copies and swaps
move whole blocks of such values).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.kernels.kv_quant import UNIT_SCALES, KVScales, dequantize, is_quantized, raw
from pagedllm.kernels.kv_write_cpu import write_kv_quantized_cpu
from pagedllm.kernels.paged_decode_attention_cpu import DecodeRows, decode_rows_attention
from pagedllm.kernels.prefill_attention_cpu import applies as compiled_prefill_applies
from pagedllm.kernels.prefill_attention_cpu import prefill_attention_cpu

# NOTE: measured on a 2-core CPU (benchmarks/cpu_attention.py): merging sequences whose
# lengths differ by up to this many tokens (or 1/8 of the shorter) costs less padding work
# than the per-group gather and SDPA calls it saves.
MAX_PAD_TOKENS = 32


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows ``rows`` (of the length-sorted batch) that share one gather and one SDPA."""

    rows: slice
    block_index: torch.Tensor  # [num_rows * num_blocks] int64: physical blocks, row-major
    mask: torch.Tensor | None  # [num_rows, 1, 1, length] bool: visible positions; None if all are
    length: int  # num_blocks * block_size


@dataclass(frozen=True)
class GroupedDecodes:
    """The decode rows sorted by how many blocks they read, in groups, for one window."""

    order: torch.Tensor | None  # [num_decodes] int64: decode rows by length; None when already sorted
    groups: list[DecodeGroup]


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's new tokens: rows ``start:end`` of the prefill part of the step."""

    start: int
    end: int
    context_len: int  # including the new tokens
    block_table: torch.Tensor  # [max_blocks] int32


@dataclass(frozen=True)
class AttentionPlan:
    """What every layer's attention reuses within one step."""

    decode_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_lens: list[int]
    block_size: int
    max_pad_tokens: int
    prefills: list[PrefillChunk]
    compiled: DecodeRows | None = None
    """Set when decode runs the compiled kernel (which needs no groups): the rows it reads, checked and
    converted once for every layer of the step."""
    _grouped: dict[int | None, GroupedDecodes] = field(default_factory=dict, compare=False, repr=False)

    def grouped(self, sliding_window: int | None = None) -> GroupedDecodes:
        """The decode groups for layers with this window, built by the first such layer of the step.

        NOTE: the cache only memoizes what the step's tables and lengths determine; a plan
        lives for one step, and layers differ only in their window (Gemma alternates two).
        """
        grouped = self._grouped.get(sliding_window)
        if grouped is None:
            grouped = _plan_decodes(
                self.decode_tables, self.decode_lens, self.block_size, self.max_pad_tokens, sliding_window
            )
            self._grouped[sliding_window] = grouped
        return grouped


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
    """Prefill chunks, and how decode rows are grouped (padding per row at most
    ``max_pad_tokens``, or 1/8 of the shortest; built per window on first use); with
    ``compiled_decode`` the decode rows are left whole for the compiled kernel."""
    cu, lens = prefill_cu_seqlens_q.tolist(), prefill_context_lens.tolist()
    prefills = [
        PrefillChunk(cu[s], cu[s + 1], length, prefill_block_tables[s])
        for s, length in enumerate(lens)
        if cu[s + 1] > cu[s]
    ]
    compiled = None
    if compiled_decode:
        compiled = DecodeRows(decode_block_tables, decode_context_lens)
    decode_lens = decode_context_lens.tolist()
    return AttentionPlan(decode_block_tables, decode_lens, block_size, max_pad_tokens, prefills, compiled)


def _plan_decodes(
    tables: torch.Tensor, lens: list[int], block_size: int, max_pad_tokens: int, window: int | None
) -> GroupedDecodes:
    starts = [0 if window is None else max(0, n - window) for n in lens]  # first visible position
    first = [s // block_size for s in starts]
    num_blocks = [-(-n // block_size) - f for n, f in zip(lens, first)]  # blocks each row reads
    order = sorted(range(len(lens)), key=num_blocks.__getitem__)
    is_sorted = order == list(range(len(lens)))
    device = tables.device
    index = None if is_sorted else torch.tensor(order, dtype=torch.int64, device=device)
    sorted_tables = tables if index is None else tables.index_select(0, index)
    rows = [_VisibleSpan(starts[i], lens[i], first[i] * block_size) for i in order]
    groups = []
    for start, end in _group_bounds([num_blocks[i] for i in order], block_size, max_pad_tokens):
        groups.append(_decode_group(sorted_tables[start:end], rows[start:end], start, end, block_size))
    return GroupedDecodes(index, groups)


@dataclass(frozen=True)
class _VisibleSpan:
    """The positions a decode row's query sees, ``start .. end - 1``, and where its first gathered block begins."""

    start: int
    end: int
    offset: int  # first visible block * block_size


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


def _decode_group(
    tables: torch.Tensor, spans: list[_VisibleSpan], start: int, end: int, block_size: int
) -> DecodeGroup:
    # tables: [rows, max_blocks] int32, sorted by the number of blocks each row reads
    num_blocks = max(-(-(s.end - s.offset) // block_size) for s in spans)
    length = num_blocks * block_size
    device = tables.device
    offsets = torch.tensor([s.offset // block_size for s in spans], dtype=torch.int64, device=device)
    cols = offsets[:, None] + torch.arange(num_blocks, device=device)  # [rows, num_blocks]
    ends = torch.tensor([-(-s.end // block_size) for s in spans], dtype=torch.int64, device=device)
    # NOTE: table entries past a row's last block, and before its window, may hold anything:
    # read its first visible block instead.
    cols = torch.where(cols < ends[:, None], cols, offsets[:, None]).clamp(max=tables.shape[1] - 1)
    blocks = tables.long().gather(1, cols)
    mask = None
    if any(s.start > s.offset or s.end < s.offset + length for s in spans):
        pos = torch.tensor([s.offset for s in spans], device=device)[:, None] + torch.arange(length, device=device)
        first = torch.tensor([s.start for s in spans], device=device)[:, None]
        last = torch.tensor([s.end for s in spans], device=device)[:, None]
        mask = ((pos >= first) & (pos < last))[:, None, None, :]
    return DecodeGroup(slice(start, end), blocks.reshape(-1), mask, length)


def _attend(
    q: torch.Tensor,  # [..., heads, q_len, head_dim]
    k: torch.Tensor,  # [..., kv_heads, length, head_dim]
    v: torch.Tensor,  # [..., kv_heads, length, head_dim]
    mask: torch.Tensor | None,  # broadcasts to [..., heads, q_len, length] bool: True = visible
    scale: float,
    logit_softcap: float | None,
    causal: bool = False,
) -> torch.Tensor:  # [..., heads, q_len, head_dim]
    """SDPA, or the same with soft-capped scores (``cap * tanh(s / cap)``) where SDPA cannot."""
    gqa = q.shape[-3] != k.shape[-3]
    if logit_softcap is None and q.dim() == 3:
        # NOTE: torch's CPU flash-attention kernel takes 4-D inputs only; 3-D ones (a prefill
        # chunk) fall back to the unfused math path, measured 1.9x slower with a mask.
        mask = mask[None, None] if mask is not None else None
        return _attend(q[None], k[None], v[None], mask, scale, None, causal)[0]
    if logit_softcap is None:
        return F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * (scale / logit_softcap)) * logit_softcap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def decode_attention(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: AttentionPlan,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scales: KVScales = UNIT_SCALES,
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
    """Each decode's query over its cached context (its window), one gather + SDPA per group of rows."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    grouped = plan.grouped(sliding_window)
    q = query if grouped.order is None else query.index_select(0, grouped.order)
    # The query heads of one KV head act as a query sequence of length `group` (GQA
    # without repeating K/V): q [rows, kv_heads, group, d] x k, v [rows, kv_heads, length, d]
    q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.empty_like(q)
    for g in grouped.groups:
        rows = g.rows.stop - g.rows.start
        keys = _blocks(key_cache, g.block_index, scales.k_scale, query.dtype).view(
            rows, g.length, num_kv_heads, head_dim
        )
        values = _blocks(value_cache, g.block_index, scales.v_scale, query.dtype).view(
            rows, g.length, num_kv_heads, head_dim
        )
        out[g.rows] = _attend(q[g.rows], keys.transpose(1, 2), values.transpose(1, 2), g.mask, scale, logit_softcap)
    out = out.view(num_seqs, num_heads, head_dim)
    return out if grouped.order is None else torch.empty_like(out).index_copy_(0, grouped.order, out)


def compiled_decode_attention(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim] float32, bfloat16 or float16
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] query's dtype
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] query's dtype
    plan: AttentionPlan,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scales: KVScales = UNIT_SCALES,
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
    """Decode through the compiled CPU kernel, which reads the cache in place (no gather)."""
    assert plan.compiled is not None, "the plan was made with compiled_decode=True"
    window, cap, rows = sliding_window, logit_softcap, plan.compiled
    return decode_rows_attention(
        query, key_cache, value_cache, rows, scale, window, cap, scales.k_scale, scales.v_scale
    )


def prefill_attention(
    query: torch.Tensor,  # [total_q, num_heads, head_dim]
    key: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    value: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: AttentionPlan,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scales: KVScales = UNIT_SCALES,
) -> torch.Tensor:  # [total_q, num_heads, head_dim]
    """Causal attention of each chunk's new tokens over its context (within the window): the
    C kernel for a bfloat16 query over a bfloat16 or 8-bit cache (it reads the cache, already
    holding the new K/V), SDPA otherwise."""
    positive = scale > 0 and scales.k_scale > 0
    if plan.prefills and positive and compiled_prefill_applies(query, key_cache, logit_softcap):
        tables = torch.stack([c.block_table for c in plan.prefills])
        chunks = [(c.start, c.end, c.context_len) for c in plan.prefills]
        k_scale, v_scale = scales.k_scale, scales.v_scale
        return prefill_attention_cpu(
            query, key_cache, value_cache, tables, chunks, scale, sliding_window, None, k_scale, v_scale
        )
    out = torch.zeros_like(query)
    block_size = key_cache.shape[1]
    for chunk in plan.prefills:
        q = query[chunk.start : chunk.end].transpose(0, 1)  # [num_heads, q_len, head_dim]
        q_len = chunk.end - chunk.start
        if chunk.context_len == q_len:  # no prefix: the new K/V is the whole context
            keys, values, offset = key[chunk.start : chunk.end], value[chunk.start : chunk.end], 0
        else:  # read from the block of the first new token's first visible position
            first_query = chunk.context_len - q_len
            offset = 0 if sliding_window is None else max(0, first_query - sliding_window + 1)
            offset -= offset % block_size
            keys = _gather(key_cache, chunk.block_table, offset, chunk.context_len, scales.k_scale, query.dtype)
            values = _gather(value_cache, chunk.block_table, offset, chunk.context_len, scales.v_scale, query.dtype)
        causal = offset == 0 and chunk.context_len == q_len and sliding_window is None
        mask = None if causal else _causal_mask(q_len, chunk.context_len, offset, sliding_window, query.device)
        o = _attend(
            q, keys.transpose(0, 1), values.transpose(0, 1), mask, scale, logit_softcap, causal
        )  # [num_heads, q_len, head_dim]
        out[chunk.start : chunk.end] = o.transpose(0, 1)
    return out


def _gather(
    cache: torch.Tensor, block_table: torch.Tensor, offset: int, length: int, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    # -> [length - offset, num_kv_heads, head_dim]: positions offset .. length - 1 (offset: a block start)
    block_size = cache.shape[1]
    blocks = block_table[offset // block_size : -(-length // block_size)].long()
    return _blocks(cache, blocks, scale, dtype).flatten(0, 1)[: length - offset]


def _blocks(cache: torch.Tensor, index: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``cache[index]``; an 8-bit cache's blocks dequantized to ``dtype`` (``scale``: fp8's per-tensor one)."""
    if not is_quantized(cache):
        return cache.index_select(0, index)
    return dequantize(raw(cache).index_select(0, index).view(cache.dtype), dtype, scale)


def _causal_mask(
    q_len: int, length: int, offset: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    # [q_len, length - offset] bool: new token i sits at position length - q_len + i, key j at offset + j
    q_pos = torch.arange(length - q_len, length, device=device)[:, None]
    k_pos = torch.arange(offset, length, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, every slot >= 0
    scales: KVScales = UNIT_SCALES,
) -> None:
    """``reshape_and_cache`` for the engine's own steps, whose slots are never negative."""
    if is_quantized(key_cache):
        write_kv_quantized_cpu(key, value, key_cache, value_cache, slot_mapping, scales.k_scale, scales.v_scale)
        return
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)
