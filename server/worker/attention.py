"""Paged attention as the models see it: metadata for one step and the layer that uses it.

The step's tokens are laid out decodes first, then prefill chunks::

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 p1 p1]       d = one new token of a decoding sequence
    decode:   q[:3]  -> paged_decode_attention     p = new tokens of a prompt chunk
    prefill:  q[3:]  -> paged_prefill_attention (cu_seqlens_q = [0, 4, 6])

A sequence verifying k proposed tokens (speculative decoding) sits in the decode part as
1 + k rows over the same block table with context lengths ``c + 1 .. c + 1 + k``: causal
attention within its chunk, on every backend's decode kernel.

Every new token's K/V is written into the cache first (``reshape_and_cache``), so both
kinds of attention can read all keys, old and new, through the block tables. The Triton
backend does exactly that; the torch backend (cpu_attention.py) plans the step once
(``AttentionOps.prepare``) and lets prefill chunks without a cached prefix use their new
K/V directly.

The metadata and the plan belong to the step and serve every layer; a layer's sliding
window, logit soft-cap and FP8 cache scales belong to the layer (Gemma alternates
windowed and global layers) and are passed at each call. A windowed layer reads only the blocks inside its
window, so the block manager may free the blocks before the window of every layer.
"""

from __future__ import annotations

import dataclasses
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

import pagedllm.kernels as kernels
from pagedllm.kernels._paged import check_window
from pagedllm.kernels.kv_quant import UNIT_SCALES, KVScales
from pagedllm.kernels.paged_decode_attention_cpu import CACHE_DTYPES, HAS_NUMBA
from pagedllm.server.worker import cpu_attention
from pagedllm.server.worker.cpu_attention import AttentionPlan


@dataclass
class AttentionMetadata:
    """Where one step's tokens go in the KV cache and what each query attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset
    num_decode_tokens: int  # the first num_decode_tokens tokens are single-token decodes
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32, including the new token
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32
    prefill_context_lens: torch.Tensor  # [num_prefills] int32, including the new tokens
    plan: AttentionPlan | None = None
    """Built on each rank from the fields above by ``AttentionOps.prepare`` (torch backend); never sent."""

    @property
    def num_prefills(self) -> int:
        return self.prefill_context_lens.numel()


TENSOR_FIELDS = (
    "slot_mapping",
    "decode_block_tables",
    "decode_context_lens",
    "prefill_block_tables",
    "prefill_cu_seqlens_q",
    "prefill_context_lens",
)
"""The fields of :class:`AttentionMetadata` that travel to other ranks and devices."""


Window = int | None  # sliding window in positions; None: the layer sees its whole context
SoftCap = float | None  # logit soft-cap; None: off


class AttentionOps(ABC):
    """How one backend writes the cache and attends; ``decode``/``prefill`` read ``meta``.

    One subclass per backend: :class:`NumbaAttention`, :class:`TorchAttention`,
    :class:`TritonAttention`; :func:`select_attention_ops` picks one.
    """

    name: ClassVar[str]

    @abstractmethod
    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping,
        scales: KVScales = UNIT_SCALES,
    ) -> None:
        """Write each new token's K/V into the cache at its slot (``meta.slot_mapping``)."""

    @abstractmethod
    def decode(
        self,
        query,
        key_cache,
        value_cache,
        meta: AttentionMetadata,
        scale: float,
        window: Window,
        softcap: SoftCap,
        scales: KVScales = UNIT_SCALES,
    ) -> torch.Tensor:
        """Attention of the step's single-token decodes (``query[:meta.num_decode_tokens]``)."""

    @abstractmethod
    def prefill(
        self,
        query,
        key,
        value,
        key_cache,
        value_cache,
        meta: AttentionMetadata,
        scale: float,
        window: Window,
        softcap: SoftCap,
        scales: KVScales = UNIT_SCALES,
    ) -> torch.Tensor:
        """Causal attention of the step's prompt chunks (the tokens after the decodes)."""

    @abstractmethod
    def copy_blocks(self, key_caches: list, value_caches: list, block_mapping: torch.Tensor) -> None:
        """Copy block ``src`` to ``dst`` (``block_mapping`` rows) in every layer's caches."""

    @abstractmethod
    def prepare(self, meta: AttentionMetadata, block_size: int) -> AttentionMetadata:
        """``meta`` with whatever the backend computes once per step (serves every layer)."""


class CpuAttention(AttentionOps):
    """What the CPU backends share: the cache write, the block copy, the per-step plan
    (decode groups or whole rows, prefill chunks) and the torch prefill over it."""

    compiled_decode: ClassVar[bool]
    """True: the plan leaves decode rows whole for the compiled kernel."""

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping, scales=UNIT_SCALES) -> None:
        cpu_attention.write_kv(key, value, key_cache, value_cache, slot_mapping, scales)

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        kernels.copy_blocks_reference(key_caches, value_caches, block_mapping)

    def prepare(self, meta: AttentionMetadata, block_size: int) -> AttentionMetadata:
        plan = cpu_attention.plan_attention(
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.prefill_block_tables,
            meta.prefill_cu_seqlens_q,
            meta.prefill_context_lens,
            block_size,
            compiled_decode=self.compiled_decode,
        )
        return dataclasses.replace(meta, plan=plan)

    def prefill(
        self, query, key, value, key_cache, value_cache, meta, scale, window, softcap, scales=UNIT_SCALES
    ) -> torch.Tensor:
        plan = self.plan_of(meta, key_cache)
        args = (query, key, value, key_cache, value_cache, plan, scale, window, softcap, scales)
        return cpu_attention.prefill_attention(*args)

    def plan_of(self, meta: AttentionMetadata, key_cache: torch.Tensor) -> AttentionPlan:
        # NOTE: the runner prepares the plan once per step; a caller that did not still gets a right answer.
        if meta.plan is not None:
            return meta.plan
        return self.prepare(meta, key_cache.shape[1]).plan  # type: ignore[return-value]


class NumbaAttention(CpuAttention):
    """CPU: decode through the compiled kernel, which reads the cache in place."""

    name = "numba"
    compiled_decode = True

    def decode(self, query, key_cache, value_cache, meta, scale, window, softcap, scales=UNIT_SCALES) -> torch.Tensor:
        plan = self.plan_of(meta, key_cache)
        args = (query, key_cache, value_cache, plan, scale, window, softcap, scales)
        return cpu_attention.compiled_decode_attention(*args)


class TorchAttention(CpuAttention):
    """CPU without numba: decode rows gathered in groups and attended with torch."""

    name = "torch"
    compiled_decode = False

    def decode(self, query, key_cache, value_cache, meta, scale, window, softcap, scales=UNIT_SCALES) -> torch.Tensor:
        plan = self.plan_of(meta, key_cache)
        return cpu_attention.decode_attention(query, key_cache, value_cache, plan, scale, window, softcap, scales)


class TritonAttention(AttentionOps):
    """CUDA: the Triton kernels read everything through the block tables; no plan."""

    name = "triton"

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping, scales=UNIT_SCALES) -> None:
        kernels.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, scales.k_scale, scales.v_scale)

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        kernels.copy_blocks(key_caches, value_caches, block_mapping)

    def prepare(self, meta: AttentionMetadata, block_size: int) -> AttentionMetadata:
        return meta

    def decode(self, query, key_cache, value_cache, meta, scale, window, softcap, scales=UNIT_SCALES) -> torch.Tensor:
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        args = (query, key_cache, value_cache, tables, lens, scale, window, softcap, scales.k_scale, scales.v_scale)
        return kernels.paged_decode_attention(*args)

    def prefill(
        self, query, key, value, key_cache, value_cache, meta, scale, window, softcap, scales=UNIT_SCALES
    ) -> torch.Tensor:
        return kernels.paged_prefill_attention(
            query,
            key,
            value,
            key_cache,
            value_cache,
            meta.prefill_block_tables,
            meta.prefill_cu_seqlens_q,
            meta.prefill_context_lens,
            scale,
            window,
            softcap,
            scales.k_scale,
            scales.v_scale,
        )


BACKENDS: dict[str, type[AttentionOps]] = {cls.name: cls for cls in (NumbaAttention, TorchAttention, TritonAttention)}
"""Each backend name and the class that implements it."""


def select_attention_ops(backend: str, device: torch.device, dtype: torch.dtype = torch.float32) -> AttentionOps:
    """``auto`` picks Triton on CUDA; on CPU the compiled decode kernel (``numba``) for
    float32, bfloat16 and float16, the plain torch path without numba.

    The environment variable ``PAGEDLLM_ATTENTION_BACKEND`` (torch|triton|numba) overrides
    an ``auto`` choice.
    """
    if backend == "auto":
        backend = os.environ.get("PAGEDLLM_ATTENTION_BACKEND") or _default_backend(device, dtype)
    if backend not in BACKENDS:
        allowed = ["auto", *sorted(BACKENDS)]
        raise ValueError(f"attention backend {backend!r} is not allowed: choose one of {allowed}")
    if backend == "numba":
        _check_numba(device, dtype)
    return BACKENDS[backend]()


def _default_backend(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        return "triton"
    return "numba" if HAS_NUMBA and dtype in CACHE_DTYPES else "torch"


def _check_numba(device: torch.device, dtype: torch.dtype) -> None:
    if not HAS_NUMBA:
        raise ValueError("attention backend 'numba' needs numba installed: pip install numba, or use 'torch'")
    if device.type != "cpu" or dtype not in CACHE_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in CACHE_DTYPES)
        raise ValueError(
            f"attention backend 'numba' runs {allowed} on the CPU, not {dtype} on {device.type}: "
            "use 'torch' or 'triton'"
        )


class PagedAttention(torch.nn.Module):
    """Multi-head (grouped-query) attention over the paged KV cache of one layer.

    ``sliding_window``: a query at position ``q`` sees keys at ``q - sliding_window < k <= q``
    (None: every key up to ``q``). ``logit_softcap``: scaled scores ``s`` become
    ``logit_softcap * tanh(s / logit_softcap)`` before masking and softmax (None: off).
    Both as Hugging Face transformers' Mistral and Gemma 2 define them.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        check_window(sliding_window, logit_softcap)
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.kv_scales = UNIT_SCALES
        """An FP8 cache's per-tensor scales: the checkpoint's (``kv_scales.load_kv_scales``) or 1.0."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        ops: AttentionOps,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads * head_dim]; k, v: [num_tokens, num_kv_heads * head_dim]
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        kv_scales = self.kv_scales
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, kv_scales)
        d = meta.num_decode_tokens
        window, softcap = self.sliding_window, self.logit_softcap
        if not meta.num_prefills and d == q.shape[0]:  # NOTE: a decode-only step: no output to assemble
            out = ops.decode(q, key_cache, value_cache, meta, self.scale, window, softcap, kv_scales)
            return out.reshape(-1, self.num_heads * self.head_dim)
        out = torch.empty_like(q)
        if d:
            out[:d] = ops.decode(q[:d], key_cache, value_cache, meta, self.scale, window, softcap, kv_scales)
        if meta.num_prefills:
            caches = (key_cache, value_cache)
            out[d:] = ops.prefill(q[d:], k[d:], v[d:], *caches, meta, self.scale, window, softcap, kv_scales)
        return out.view(-1, self.num_heads * self.head_dim)
