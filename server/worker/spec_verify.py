"""Speculative verification on the worker: which proposals the target accepts, and the token after them.

A sequence verifying ``k`` proposals has ``1 + k`` logits rows, one per position from its
newest token on; each row was described by the engine with the proposals before it counted
as output (penalties, ``min_tokens``). Greedy rows accept while the argmax agrees; sampled
rows follow :func:`~pagedllm.server.worker.rejection_sampler.sample_accept`, drawing from the
request's own generator so that a seeded request gets the tokens it would get without
proposals. Log-probabilities, where asked, are the raw model's at each emitted position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.server.worker.greedy import greedy_ids
from pagedllm.server.worker.logits_processors import filtered_probs, process
from pagedllm.server.worker.logprobs import gather_logprobs, tokens_of
from pagedllm.server.worker.rejection_sampler import greedy_accept, sample_accept
from pagedllm.server.worker.sampling_batch import RowSampling, SpecVerify, Tokens


class SpecVerifier:
    """Accepts proposals; draws from the generators its sampler owns."""

    def __init__(self, generator_of: Callable[[RowSampling], torch.Generator]) -> None:
        self.generator_of = generator_of

    def verify(
        self, logits: torch.Tensor, rows: list[RowSampling], groups: list[SpecVerify], units: list[int]
    ) -> dict[int, Tokens]:
        """Emitted tokens of each of ``groups`` (unit ``units[i]`` for ``groups[i]``)."""
        spans: list[tuple[int, int]] = []
        index: list[int] = []
        for group in groups:
            spans.append((len(index), len(index) + len(group.draft_token_ids) + 1))
            index.extend(range(group.first_row, group.first_row + len(group.draft_token_ids) + 1))
        view = logits[torch.tensor(index, dtype=torch.int64, device=logits.device)]
        picked = [rows[r] for r in index]
        processed = process(view, picked)
        emitted = self._greedy(processed, picked, groups, spans)
        emitted.update(self._sampled(processed, picked, groups, spans))
        results = self._logprobs(view, picked, groups, spans, emitted)
        return {units[g]: tokens for g, tokens in results.items()}

    @staticmethod
    def _greedy(
        processed: torch.Tensor, picked: list[RowSampling], groups: list[SpecVerify], spans: list[tuple[int, int]]
    ) -> dict[int, list[int]]:
        chosen = [g for g, (start, _) in enumerate(spans) if picked[start].greedy]
        if not chosen:
            return {}
        index = [r for g in chosen for r in range(*spans[g])]
        best = greedy_ids(processed[torch.tensor(index, dtype=torch.int64, device=processed.device)]).tolist()
        emitted, at = {}, 0
        for g in chosen:
            n = spans[g][1] - spans[g][0]
            emitted[g] = greedy_accept(best[at : at + n], list(groups[g].draft_token_ids))
            at += n
        return emitted

    def _sampled(
        self, processed: torch.Tensor, picked: list[RowSampling], groups: list[SpecVerify], spans: list[tuple[int, int]]
    ) -> dict[int, list[int]]:
        chosen = [g for g, (start, _) in enumerate(spans) if not picked[start].greedy]
        if not chosen:
            return {}
        index = [r for g in chosen for r in range(*spans[g])]
        index_t = torch.tensor(index, dtype=torch.int64, device=processed.device)
        probs = filtered_probs(processed[index_t], [picked[r] for r in index])
        emitted, at = {}, 0
        for g in chosen:
            n = spans[g][1] - spans[g][0]
            generator = self.generator_of(picked[spans[g][0]])
            emitted[g] = sample_accept(probs[at : at + n], list(groups[g].draft_token_ids), generator)
            at += n
        return emitted

    @staticmethod
    def _logprobs(
        view: torch.Tensor,
        picked: list[RowSampling],
        groups: list[SpecVerify],
        spans: list[tuple[int, int]],
        emitted: dict[int, list[int]],
    ) -> dict[int, Tokens]:
        """Each group's emitted tokens, with the raw model's log-probabilities at their positions where asked."""
        results = {g: Tokens(emitted[g]) for g in range(len(groups))}
        wanted = [g for g, (start, _) in enumerate(spans) if _wants(picked[start])]
        if not wanted:
            return results
        index = [spans[g][0] + i for g in wanted for i in range(len(emitted[g]))]
        raw = torch.log_softmax(view[torch.tensor(index, dtype=torch.int64, device=view.device)], dim=-1)
        tokens = torch.tensor([t for g in wanted for t in emitted[g]], dtype=torch.int64, device=view.device)
        nums = [picked[spans[g][0]].num_logprobs for g in wanted for _ in emitted[g]]
        per_row = gather_logprobs(raw, tokens.unsqueeze(1), nums).tolist([1] * len(index), nums)
        at = 0
        for g in wanted:
            results[g] = tokens_of(emitted[g], per_row[at : at + len(emitted[g])])
            at += len(emitted[g])
        return results


def _wants(row: RowSampling) -> bool:
    return row.needs_logprobs or row.num_logprobs is not None
