"""From logits to tokens: penalties, temperature, top-k / top-p / min-p, seeded sampling, logprobs.

Returned log-probabilities are those of the model's own distribution (``log_softmax``
of the raw logits), whatever processing chose the token, so they compare with the
reference model's and add up to ``cumulative_logprob``.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pagedllm.server.outputs import Logprob
from pagedllm.server.sampling_params import SamplingParams


@dataclass
class SampleRequest:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    prompt_token_ids: Seq[int]
    output_token_ids: Seq[int]
    num_samples: int = 1  # best_of draws at a group's first token, else 1
    generator: torch.Generator | None = None
    eos_token_ids: tuple[int, ...] = ()
    allowed: torch.Tensor | None = None
    """[vocab] bool: the only tokens a grammar lets come next (structured outputs)."""


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token
    top_logprobs: list[dict[int, Logprob] | None]  # per sampled token, when asked for


class Sampler:
    """Stateless apart from the engine-wide generator used by unseeded requests."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[Sample]:
        # logits: [num_rows, vocab] float32
        raw_logprobs, logits = self.process(logits, requests)
        sampled = self._sample(logits, requests)
        return self._results(raw_logprobs, sampled, requests)

    @staticmethod
    def process(logits: torch.Tensor, requests: list[SampleRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's log-probabilities and the logits after penalties, ``min_tokens``, bias and grammar."""
        logits = logits.float().cpu()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = [i for i, req in enumerate(requests) if _needs_processing(req)]
        if processed:  # NOTE: plain rows (the usual case) skip the per-row work and the copy
            logits = logits.clone()
            for i in processed:
                _apply_penalties(logits[i], requests[i])
                _block_early_stop(logits[i], requests[i])
                _apply_bias_and_mask(logits[i], requests[i])
        return raw_logprobs, logits

    def _sample(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[list[int]]:
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        sampled: list[list[int]] = [[] for _ in requests]
        if greedy:
            rows = logits if len(greedy) == len(requests) else logits[greedy]
            for i, t in zip(greedy, rows.argmax(dim=-1).tolist()):
                sampled[i] = [t] * requests[i].num_samples
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random_rows:
            rows = logits if len(random_rows) == len(requests) else logits[random_rows]
            probs = filtered_probs(rows, [requests[i].params for i in random_rows])
            for row, i in enumerate(random_rows):
                req = requests[i]
                draw = torch.multinomial(
                    probs[row], req.num_samples, replacement=True, generator=req.generator or self.generator
                )
                sampled[i] = draw.tolist()
        return sampled

    @staticmethod
    def _results(logprobs: torch.Tensor, sampled: list[list[int]], requests: list[SampleRequest]) -> list[Sample]:
        # logprobs: [num_rows, vocab]; one gather for every sampled token of every row
        width = max(len(tokens) for tokens in sampled)
        index = torch.tensor([tokens + tokens[-1:] * (width - len(tokens)) for tokens in sampled], dtype=torch.int64)
        chosen = logprobs.gather(1, index).tolist()
        results = []
        for i, (tokens, req) in enumerate(zip(sampled, requests)):
            tops = [top_logprobs(logprobs[i], t, req.params.logprobs) for t in tokens]
            results.append(Sample(tokens, chosen[i][: len(tokens)], tops))
        return results


def top_logprobs(logprobs: torch.Tensor, token: int, num: int | None) -> dict[int, Logprob] | None:
    """The ``num`` most likely tokens of one position plus ``token`` itself, with ranks."""
    if num is None:
        return None
    result: dict[int, Logprob] = {}
    if num > 0:
        values, ids = logprobs.topk(num)
        result = {int(t): Logprob(float(v), rank + 1) for rank, (v, t) in enumerate(zip(values, ids))}
    if token not in result:
        rank = int((logprobs > logprobs[token]).sum()) + 1
        result[token] = Logprob(float(logprobs[token]), rank)
    return result


_LOGIT_LIMIT = 1e30


def _needs_processing(req: SampleRequest) -> bool:
    """Whether any logits processor changes this row (penalties, min_tokens, bias, grammar)."""
    p = req.params
    return (
        p.repetition_penalty != 1.0
        or bool(p.presence_penalty or p.frequency_penalty)
        or len(req.output_token_ids) < p.min_tokens
        or bool(p.logit_bias)
        or req.allowed is not None
    )


def _apply_penalties(logits: torch.Tensor, req: SampleRequest) -> None:
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(req.output_token_ids)), dtype=torch.int64)
        values = logits[seen]
        penalized = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        # NOTE: a tiny penalty overflows to inf, which sampling cannot draw from.
        logits[seen] = penalized.clamp(min=-_LOGIT_LIMIT, max=_LOGIT_LIMIT)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        counts = torch.bincount(torch.tensor(req.output_token_ids, dtype=torch.int64), minlength=logits.numel())
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _apply_bias_and_mask(logits: torch.Tensor, req: SampleRequest) -> None:
    """``logit_bias`` values are added; tokens a grammar forbids can never be chosen."""
    bias = req.params.logit_bias
    if bias:
        ids = torch.tensor([t for t in bias if 0 <= t < logits.numel()], dtype=torch.int64)
        logits[ids] += torch.tensor([bias[t] for t in bias if 0 <= t < logits.numel()], dtype=logits.dtype)
    if req.allowed is not None:
        logits.masked_fill_(~req.allowed, float("-inf"))


def _block_early_stop(logits: torch.Tensor, req: SampleRequest) -> None:
    """Before ``min_tokens`` are generated, EOS and the stop token ids cannot be chosen."""
    if len(req.output_token_ids) >= req.params.min_tokens:
        return
    banned = list(req.params.stop_token_ids)
    if not req.params.ignore_eos:
        banned += list(req.eos_token_ids)
    if not banned:
        return
    index = torch.tensor(banned, dtype=torch.int64)
    if req.allowed is not None and not req.allowed.clone().index_fill_(0, index, False).any():
        return  # NOTE: a complete grammar allows only the end: it wins over min_tokens
    logits[index] = float("-inf")


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks, as probabilities. logits: [rows, vocab]."""
    temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    logits = logits / temperature
    if all(p.top_k == 0 and p.top_p >= 1.0 and p.min_p == 0.0 for p in params):
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
    ranks = torch.arange(vocab).unsqueeze(0)
    remove = ranks >= top_k
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
    remove |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p  # NOTE: the top token always stays
    min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
    remove |= sorted_probs < min_p * sorted_probs[:, :1]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    filtered = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)
