"""Small factories for kernel tests: paged caches built independently of the kernels,
a naive dense attention oracle, tolerances and device selection."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

# Triton kernels run on CUDA when there is one, else through the interpreter on CPU
# (tests/conftest.py sets TRITON_INTERPRET=1 before pagedllm.kernels is imported).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

_needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device; on CPU the same comparisons run through Triton's interpreter",
)


def gpu_test(fn):
    """Mark a test ``gpu`` and skip it, saying why, where CUDA is absent."""
    return pytest.mark.gpu(_needs_cuda(fn))


TOLERANCES = {
    torch.float32: dict(atol=5e-5, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, seed: int) -> None:
    assert not torch.isnan(actual).any(), f"NaN in output (seed={seed})"
    torch.testing.assert_close(
        actual.float(), expected.float(), **TOLERANCES[actual.dtype], msg=lambda m: f"seed={seed}: {m}"
    )


@dataclass
class PagedKV:
    """Per-sequence contiguous K/V and the same data scattered into paged caches."""

    keys: list[torch.Tensor]  # per seq: [len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32


def make_paged_kv(
    lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    device: str = DEVICE,
    spare_blocks: int = 3,
    caches: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_ids: torch.Tensor | None = None,
    visible_from: list[int] | None = None,
) -> PagedKV:
    """Random K/V per sequence written into caches through a permuted block table.

    Unused cache slots are NaN, and table entries past each sequence's last block are
    garbage (a huge id), so a kernel that reads outside the context shows it. With
    ``visible_from`` (the first position any query of sequence ``s`` sees, as under a
    sliding window) the entries of blocks wholly before it are garbage too and their
    blocks NaN, as if freed: a kernel that reads them shows it. ``caches`` and
    ``block_ids`` let a test bring huge (virtual) caches and far-away block ids.
    """
    blocks_per_seq = [-(-n // block_size) for n in lens]
    needed = sum(blocks_per_seq)
    if caches is None:
        shape = (needed + spare_blocks, block_size, num_kv_heads, head_dim)
        caches = (
            torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, float("nan"), dtype=dtype, device=device),
        )
    key_cache, value_cache = caches
    if block_ids is None:
        block_ids = torch.randperm(key_cache.shape[0])[:needed]
    max_blocks = max(blocks_per_seq, default=0) + 2
    block_tables = torch.full((len(lens), max_blocks), 2**31 - 1, dtype=torch.int32)
    keys, values, used = [], [], 0
    for s, n in enumerate(lens):
        table = block_ids[used : used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        block_tables[s, : len(table)] = table.to(torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, device=device).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, device=device).to(dtype)
        pos = torch.arange(n)
        blocks, slots = table[pos // block_size].to(device), (pos % block_size).to(device)
        key_cache[blocks, slots] = k
        value_cache[blocks, slots] = v
        keys.append(k)
        values.append(v)
    for s, first in enumerate(visible_from or []):
        dead = block_tables[s, : first // block_size]
        key_cache[dead.long()] = float("nan")
        value_cache[dead.long()] = float("nan")
        block_tables[s, : first // block_size] = 2**31 - 1
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return PagedKV(keys, values, key_cache, value_cache, block_tables.to(device), context_lens)


def naive_attention(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k: torch.Tensor,  # [length, num_kv_heads, head_dim]
    v: torch.Tensor,  # [length, num_kv_heads, head_dim]
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [q_len, num_heads, head_dim], float64
    """Dense causal attention in float64; the queries are the last ``q_len`` positions.

    With ``sliding_window`` a query at ``q`` sees keys ``k`` with ``q - window < k <= q``;
    ``logit_softcap`` maps each scaled score ``s`` to ``cap * tanh(s / cap)`` (as
    transformers' Mistral and Gemma 2 do)."""
    q_len, num_heads, _ = q.shape
    length, num_kv_heads, _ = k.shape
    if length == 0:
        return torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # [length, num_heads, head_dim]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q.double(), k) * scale
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    q_pos = torch.arange(length - q_len, length, device=q.device)[:, None]
    k_pos = torch.arange(length, device=q.device)[None, :]
    hidden = k_pos > q_pos
    if sliding_window is not None:
        hidden |= k_pos <= q_pos - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), v)


def huge_cache(shape: tuple[int, ...], dtype: torch.dtype, device: str = DEVICE) -> torch.Tensor:
    """``torch.empty`` of more than 2**31 elements, so that ``block_id * block_stride``
    overflows int32. On CPU only the pages a test touches get memory (Linux overcommit),
    so it is cheap; on a GPU it is really allocated. Skips where it is refused."""
    assert torch.Size(shape).numel() > 2**31
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    except RuntimeError as err:  # pragma: no cover - depends on the machine's overcommit
        pytest.skip(f"cannot reserve a >2**31-element virtual cache here: {err}")


def near_bf16_tie(exact: torch.Tensor, ulps: int = 4) -> torch.Tensor:
    """Where a float32 value ``ulps`` float32 ulps either way would round to another bfloat16:
    the elements where a kernel's float32 math, a few ulps from torch's, may round differently."""
    low, high = exact.float(), exact.float()
    for _ in range(ulps):
        low, high = torch.nextafter(low, torch.tensor(-torch.inf)), torch.nextafter(high, torch.tensor(torch.inf))
    return low.bfloat16() != high.bfloat16()


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Torch's thread count set to ``threads`` (the CPU kernels follow it) and restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
