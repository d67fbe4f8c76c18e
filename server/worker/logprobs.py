"""Log-probabilities a request asked for, gathered on the device from ``log_softmax`` of raw logits.

Reported log-probabilities are those of the model's own distribution, whatever processing
(penalties, bias, grammar, temperature, top-k/p) chose the token, so they compare with the
reference model's and add up to ``cumulative_logprob``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagedllm.server.worker.sampling_batch import Tokens


class RowLogprobs(NamedTuple):
    """One row's tokens' log-probabilities, ranks and tops (None where not asked), read back."""

    chosen: list[float]
    ranks: list[int] | None
    top: list[list[tuple[int, float]]] | None


@dataclass
class PendingLogprobs:
    """Device tensors of some rows' token log-probabilities, read back together at the end of the step."""

    chosen: torch.Tensor
    """[rows, tokens] the tokens' log-probabilities."""
    ranks: torch.Tensor | None
    """[rows, tokens] their ranks (1: likeliest), when top log-probabilities are asked."""
    top_values: torch.Tensor | None
    """[rows, max top] the likeliest log-probabilities, best first."""
    top_ids: torch.Tensor | None

    def to_host(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> PendingLogprobs:
        """These tensors passed through ``copy`` (a queued copy to the host: read them once it has run)."""
        ranks, values, ids = self.ranks, self.top_values, self.top_ids
        return PendingLogprobs(
            copy(self.chosen),
            copy(ranks) if ranks is not None else None,
            copy(values) if values is not None else None,
            copy(ids) if ids is not None else None,
        )

    def tolist(self, counts: Sequence[int], num_top: Sequence[int | None]) -> list[RowLogprobs]:
        """Per row: its first ``counts[i]`` tokens' log-probabilities, ranks and tops (``num_top[i]`` each)."""
        chosen = self.chosen.tolist()
        ranks = self.ranks.tolist() if self.ranks is not None else None
        top_values = self.top_values.tolist() if self.top_values is not None else None
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        rows = []
        for i, (count, num) in enumerate(zip(counts, num_top)):
            if num is None or ranks is None:
                rows.append(RowLogprobs(chosen[i][:count], None, None))
                continue
            top = list(zip(top_ids[i][:num], top_values[i][:num])) if top_ids and top_values else []
            rows.append(RowLogprobs(chosen[i][:count], ranks[i][:count], [top] * count))
        return rows


def gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor, num_top: Sequence[int | None]) -> PendingLogprobs:
    """``raw``: [rows, vocab] log-probabilities; ``tokens``: [rows, per row] int64 ids at each row's position.

    Ranks and the top ``num_top[i]`` are computed only where some row asked (not None).
    """
    chosen = raw.gather(1, tokens)
    if all(num is None for num in num_top):
        return PendingLogprobs(chosen, None, None, None)
    ranks = (raw.unsqueeze(1) > chosen.unsqueeze(2)).sum(dim=-1) + 1
    k = max(num for num in num_top if num is not None)
    if k == 0:
        return PendingLogprobs(chosen, ranks, None, None)
    values, ids = raw.topk(min(k, raw.shape[1]), dim=-1)
    return PendingLogprobs(chosen, ranks, values, ids)


def tokens_of(token_ids: list[int], rows: Sequence[RowLogprobs]) -> Tokens:
    """``token_ids`` with the log-probabilities of ``rows``' first tokens, one row per token (positions)."""
    asked = bool(rows) and rows[0].ranks is not None
    return Tokens(
        token_ids,
        [row.chosen[0] for row in rows],
        [row.ranks[0] for row in rows if row.ranks is not None] if asked else None,
        [row.top[0] for row in rows if row.top is not None] if asked else None,
    )
