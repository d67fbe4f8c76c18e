"""Triton kernels (PagedAttention, mixture-of-experts, multi-LoRA, quantized matmuls) and their plain-torch references.

Every op comes as a Triton launcher and a ``*_reference`` twin with the same signature:
the Triton versions run on CUDA (or on CPU through ``TRITON_INTERPRET=1``), the
references run anywhere torch does. Triton is optional: without it this package still
imports and the references work; calling a Triton launcher raises a ``RuntimeError``.

All caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, in the model's
dtype or 8-bit (kv_quant.py: an int8 row is ``head_dim + 2`` wide, its scale last).
"""

from ._triton import HAS_TRITON, runs_on_triton
from .copy_blocks import copy_blocks, copy_blocks_reference
from .fp8_matmul import fp8_linear, fp8_linear_reference
from .fused_moe import fused_moe, fused_moe_reference
from .lora_matmul import lora_expand, lora_expand_reference, lora_shrink, lora_shrink_reference
from .paged_decode_attention import paged_decode_attention, paged_decode_attention_reference
from .paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_reference
from .quant_matmul import w4a16_matmul, w4a16_matmul_reference
from .reshape_and_cache import reshape_and_cache, reshape_and_cache_reference

__all__ = [
    "HAS_TRITON",
    "copy_blocks",
    "copy_blocks_reference",
    "fp8_linear",
    "fp8_linear_reference",
    "fused_moe",
    "fused_moe_reference",
    "lora_expand",
    "lora_expand_reference",
    "lora_shrink",
    "lora_shrink_reference",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "reshape_and_cache",
    "reshape_and_cache_reference",
    "runs_on_triton",
    "w4a16_matmul",
    "w4a16_matmul_reference",
]
