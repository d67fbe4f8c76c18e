"""From logits to tokens: penalties, temperature, top-k / top-p / min-p, seeded sampling, logprobs.

Returned log-probabilities are those of the model's own distribution (``log_softmax``
of the raw logits), whatever processing chose the token, so they compare with the
reference model's and add up to ``cumulative_logprob``. A greedy row that asked for no
logprobs (and draws one sample per sequence) needs only the argmax: its logprob is not
computed (None), as vLLM reports no cumulative logprob for such requests.

Penalties read a sequence's tokens through :class:`TokenCounts`, which the engine keeps
per sequence and brings up to date with the tokens appended since its last step.
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
    counts: TokenCounts | None = None
    """This sequence's token counts from earlier steps, for the penalties (None: counted afresh)."""


class TokenCounts:
    """One sequence's tokens as the penalties read them, counted once and then updated by appends.

    NOTE: the sequence only ever grows by appended output tokens (a recomputed sequence
    keeps its tokens), so the first ``num_counted`` output tokens are never counted again.
    """

    def __init__(self) -> None:
        self.seen: torch.Tensor | None = None
        """[vocab] bool: the token occurs in the prompt or the output."""
        self.output_counts: torch.Tensor | None = None
        """[vocab] int64: how often the token occurs in the output."""
        self.num_counted = 0

    def update(self, prompt_token_ids: Seq[int], output_token_ids: Seq[int], vocab: int) -> None:
        """Count the prompt on the first call, then the output tokens appended since the last."""
        if self.seen is None or self.output_counts is None:
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            self.seen[torch.tensor(list(prompt_token_ids), dtype=torch.int64)] = True
            self.output_counts = torch.zeros(vocab, dtype=torch.int64)
        new = output_token_ids[self.num_counted :]
        if len(new):
            index = torch.tensor(list(new), dtype=torch.int64)
            self.output_counts.index_add_(0, index, torch.ones_like(index))
            self.seen[index] = True
            self.num_counted = len(output_token_ids)


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float | None]  # of each sampled token; None where the row needed none (see the module)
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
    def process(logits: torch.Tensor, requests: list[SampleRequest]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """The model's log-probabilities (row -> [vocab], for the rows that need them) and the logits
        after penalties, ``min_tokens``, bias and grammar."""
        logits = logits.float().cpu()
        wanted = [i for i, req in enumerate(requests) if _needs_logprobs(req)]
        raw_logprobs = _log_softmax_rows(logits, wanted)
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
    def _results(
        logprobs: dict[int, torch.Tensor], sampled: list[list[int]], requests: list[SampleRequest]
    ) -> list[Sample]:
        # logprobs: row -> [vocab], for the rows that need them
        results = []
        for i, (tokens, req) in enumerate(zip(sampled, requests)):
            row = logprobs.get(i)
            if row is None:
                results.append(Sample(tokens, [None] * len(tokens), [None] * len(tokens)))
                continue
            chosen = row[torch.tensor(tokens, dtype=torch.int64)].tolist()
            tops = [top_logprobs(row, t, req.params.logprobs) for t in tokens]
            results.append(Sample(tokens, chosen, tops))
        return results


def _needs_logprobs(req: SampleRequest) -> bool:
    """Whether a row's logprobs are reported or ranked (see the module docstring)."""
    p = req.params
    return not p.greedy or p.logprobs is not None or p.best_of > p.n or req.num_samples > 1


def _log_softmax_rows(logits: torch.Tensor, rows: list[int]) -> dict[int, torch.Tensor]:
    """``log_softmax`` of the raw logits of ``rows`` only: row -> [vocab]."""
    if not rows:
        return {}
    picked = logits if len(rows) == logits.shape[0] else logits[rows]
    return dict(zip(rows, torch.log_softmax(picked, dim=-1)))


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
    repetition = p.repetition_penalty != 1.0
    occurrence = bool(p.presence_penalty or p.frequency_penalty) and len(req.output_token_ids) > 0
    if not (repetition or occurrence):
        return
    counts = req.counts if req.counts is not None else TokenCounts()
    counts.update(req.prompt_token_ids, req.output_token_ids, logits.numel())
    assert counts.seen is not None and counts.output_counts is not None
    if repetition:
        penalized = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        # NOTE: a tiny penalty overflows to inf, which sampling cannot draw from.
        penalized = penalized.clamp(min=-_LOGIT_LIMIT, max=_LOGIT_LIMIT)
        torch.where(counts.seen, penalized, logits, out=logits)
    if occurrence:
        output = counts.output_counts
        logits -= p.frequency_penalty * output + p.presence_penalty * (output > 0)


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
