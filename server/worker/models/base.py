"""What the model runner needs of a model class: the contract every architecture here satisfies."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from pagedllm.server.worker.attention import AttentionMetadata, AttentionOps
from pagedllm.server.worker.models.tensor_parallel import TPGroup

KVCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's (K, V) cache: each [num_blocks, block_size, num_kv_heads, head_dim]."""


class CausalLM(Protocol):
    """A decoder-only language model written for paged attention (an ``nn.Module``)."""

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], tp: TPGroup = ...) -> CausalLM:
        """Build this rank's part of the model, weights uninitialised, from a Hugging Face ``config.json``."""
        ...

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the KV cache the model needs."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        ops: AttentionOps,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [rows, hidden_size] -> float32 logits [rows, vocab_size]."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by their Hugging Face names; each parameter exactly once."""
        ...

    def eval(self) -> Any: ...

    def named_parameters(self) -> Any: ...
