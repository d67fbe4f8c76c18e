"""Megatron-style tensor parallelism for the models: sharded linears, embedding and LM head.

Each rank keeps a slice of every large weight and computes its share of each layer::

    ColumnParallelLinear   W: [out, in] split by output rows  -> each rank: y[:, its rows]
    RowParallelLinear      W: [out, in] split by input cols   -> partial sums, all-reduced
    VocabParallelEmbedding table split by vocab rows           -> lookups of other rows are 0, all-reduced
    ParallelLMHead         W: [vocab, hidden] split by rows    -> logit slices gathered on rank 0

Attention heads follow the column split (QKV) and the row split (output projection), so
no communication happens inside attention: two all-reduces per layer, as in Megatron-LM.

Loading: every sharded parameter carries ``param.shard(full_tensor) -> its slice``, which
:func:`pagedllm.server.worker.models.checkpoint.copy_weights` applies to each checkpoint
tensor as it arrives, so a rank never keeps more than its shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pagedllm.server.config import ConfigError
from pagedllm.server.worker.models.cpu_linear import PackableLinear, linear


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group (size 1: no parallelism)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    """The torch.distributed process group of the ranks (None for size 1: the default group)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, on rank 0 (others get theirs back)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else x

    def split(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (which must divide evenly)."""
        if total % self.size:
            raise ConfigError(
                "tensor_parallel_size",
                self.size,
                f"a divisor of the model's {what} ({total})",
                problem="is not allowed",
            )
        return total // self.size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(KV heads this rank keeps, index of its first). Fewer KV heads than ranks: each is
        replicated on ``size // num_kv_heads`` consecutive ranks."""
        if num_kv_heads >= self.size:
            per_rank = self.split(num_kv_heads, "number of key/value heads")
            return per_rank, self.rank * per_rank
        if self.size % num_kv_heads:
            raise ConfigError(
                "tensor_parallel_size",
                self.size,
                f"a divisor or a multiple of the model's {num_kv_heads} key/value heads",
                problem="is not allowed",
            )
        return 1, self.rank * num_kv_heads // self.size


def _rows(start: int, length: int, dim: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda full: full.narrow(dim, start, length)


def mark_shard(param: torch.Tensor, shard: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Tell the loader how to cut this rank's slice out of the full checkpoint tensor."""
    param.shard = shard  # type: ignore[attr-defined]


class ColumnParallelLinear(nn.Linear, PackableLinear):
    """A linear layer whose output features are split across ranks (no communication).

    ``rows(rank)`` may name this rank's output rows of the full weight when they are not
    the plain ``rank``-th slice (replicated KV heads).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, first_row: int | None = None):
        local = tp.split(out_features, "projection width") if first_row is None else out_features
        super().__init__(in_features, local, bias=bias)
        start = tp.rank * local if first_row is None else first_row
        if tp.size > 1:
            mark_shard(self.weight, _rows(start, local))
            if self.bias is not None:
                mark_shard(self.bias, _rows(start, local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(PackableLinear):
    """A linear layer whose input features are split across ranks; partial outputs are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        local = tp.split(in_features, "projection width")
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if tp.size > 1:
            mark_shard(self.weight, _rows(tp.rank * local, local, dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: the bias is added once, after the sum of the partial products.
        y = self.tp.all_reduce(linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows (padded so every rank holds the same number)."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim))
        if tp.size > 1:
            mark_shard(self.weight, self._shard)

    def _shard(self, full: torch.Tensor) -> torch.Tensor:
        part = full[self.start : self.start + self.rows]
        if part.shape[0] < self.rows:  # NOTE: the last rank's padding rows are never looked up
            part = torch.cat([part, part.new_zeros(self.rows - part.shape[0], *part.shape[1:])])
        return part

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0.0))


class ParallelLMHead(PackableLinear):
    """The output projection to the vocabulary, split like :class:`VocabParallelEmbedding`.

    Logits come back whole on rank 0 (where sampling runs); other ranks get their slice.
    """

    def __init__(self, dim: int, vocab_size: int, tp: TPGroup, tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.tied = tied is not None
        if tied is not None:
            self.weight = tied.weight
        else:
            embedding_like = VocabParallelEmbedding(vocab_size, dim, tp)
            self.weight = embedding_like.weight

    def packable(self) -> bool:
        """Always: a tied head packs a copy of its own and the embedding keeps the plain table.

        NOTE: lookups index the embedding table, so a tied table cannot be packed in place. The
        product over the vocabulary is a decode step's largest GEMM (Qwen2.5-0.5B: 151,936 x 896,
        a quarter of the weights), and on the plain table it runs as an unpacked matmul at half
        the packed speed, so the head's copy (vocab x hidden more bytes) pays for itself.
        """
        return True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather_last_dim(linear(hidden, self.weight).float())
        return logits[..., : self.vocab_size] if self.tp.rank == 0 else logits
