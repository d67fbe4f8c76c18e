"""Logits processors as batched tensor ops: penalties, ``min_tokens``, ``logit_bias``, grammar masks,
then temperature / top-k / top-p / min-p into the probabilities a row is drawn from.

Every function takes ``[rows, vocab]`` float32 logits on the worker's device and the rows'
:class:`~pagedllm.server.worker.sampling_batch.RowSampling`, one per logits row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedllm.server.worker.sampling_batch import RowSampling

_LOGIT_LIMIT = 1e30


def process(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """The logits after penalties, ``min_tokens``, bias and grammar (a copy; ``logits`` itself when no
    row has a processor, the usual case)."""
    if not any(row.processed for row in rows):
        return logits
    logits = logits.clone()
    penalized = [i for i, row in enumerate(rows) if row.penalized]
    if penalized:
        _apply_penalties(logits, rows, penalized)
    masked = [i for i, row in enumerate(rows) if row.allowed is not None]
    allowed = unpack_masks([rows[i].allowed for i in masked], logits.shape[1], logits.device) if masked else None
    banned = [i for i, row in enumerate(rows) if row.banned_token_ids]
    if banned:
        _ban(logits, rows, banned, dict(zip(masked, allowed)) if allowed is not None else {})
    _add_bias(logits, rows)
    if allowed is not None:
        index = torch.tensor(masked, dtype=torch.int64, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def unpack_masks(packed: list, vocab: int, device: torch.device) -> torch.Tensor:
    """[len(packed), vocab] bool from xgrammar's packed int32 bitmasks (bit j of word w: token 32w + j)."""
    words = torch.from_numpy(np.stack(packed).astype(np.int32, copy=False)).to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.view(len(packed), -1)[:, :vocab].bool()


def _row_index(rows: Sequence[RowSampling], chosen: list[int], field: str) -> tuple[np.ndarray, np.ndarray]:
    """(row, token) pairs of every token id in the ``field`` arrays of the ``chosen`` rows (row: 0..len-1)."""
    arrays = [getattr(rows[i], field) for i in chosen]
    arrays = [a if a is not None else np.zeros(0, dtype=np.int64) for a in arrays]
    row = np.repeat(np.arange(len(chosen), dtype=np.int64), [len(a) for a in arrays])
    return row, np.concatenate(arrays).astype(np.int64, copy=False) if arrays else np.zeros(0, dtype=np.int64)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[RowSampling], chosen: list[int]) -> None:
    """Repetition penalty on every token seen in prompt or output; presence and frequency on the output's."""
    device, vocab = logits.device, logits.shape[1]
    out_row, out_tok = _row_index(rows, chosen, "output_token_ids")
    prompt_row, prompt_tok = _row_index(rows, chosen, "prompt_token_ids")
    counts = torch.zeros((len(chosen), vocab), dtype=torch.float32, device=device)
    out_index = (torch.from_numpy(out_row).to(device), torch.from_numpy(out_tok).to(device))
    counts.index_put_(out_index, torch.ones(out_row.size, device=device), accumulate=True)
    index = torch.tensor(chosen, dtype=torch.int64, device=device)
    view = logits[index]
    repetition = torch.tensor([rows[i].repetition_penalty for i in chosen], device=device).unsqueeze(1)
    seen = counts > 0
    seen[torch.from_numpy(prompt_row).to(device), torch.from_numpy(prompt_tok).to(device)] = True
    seen &= repetition != 1.0
    penalized = torch.where(view > 0, view / repetition, view * repetition)
    # NOTE: a tiny penalty overflows to inf, which sampling cannot draw from.
    penalized = penalized.clamp(min=-_LOGIT_LIMIT, max=_LOGIT_LIMIT)
    view = torch.where(seen, penalized, view)
    frequency = torch.tensor([rows[i].frequency_penalty for i in chosen], device=device).unsqueeze(1)
    presence = torch.tensor([rows[i].presence_penalty for i in chosen], device=device).unsqueeze(1)
    view -= frequency * counts + presence * (counts > 0)
    logits[index] = view


def _ban(
    logits: torch.Tensor, rows: Sequence[RowSampling], chosen: list[int], allowed: dict[int, torch.Tensor]
) -> None:
    """Before ``min_tokens`` are generated, EOS and the stop token ids cannot be chosen."""
    device = logits.device
    ban = torch.zeros((len(chosen), logits.shape[1]), dtype=torch.bool, device=device)
    row = np.repeat(np.arange(len(chosen)), [len(rows[i].banned_token_ids) for i in chosen])
    tok = np.concatenate([np.asarray(rows[i].banned_token_ids, dtype=np.int64) for i in chosen])
    ban[torch.from_numpy(row).to(device), torch.from_numpy(tok).to(device)] = True
    constrained = [k for k, i in enumerate(chosen) if i in allowed]
    if constrained:  # NOTE: a complete grammar allows only the end: it wins over min_tokens
        masks = torch.stack([allowed[chosen[k]] for k in constrained])
        keep = (masks & ~ban[constrained]).any(dim=-1, keepdim=True)
        ban[constrained] &= keep
    index = torch.tensor(chosen, dtype=torch.int64, device=device)
    logits[index] = logits[index].masked_fill(ban, float("-inf"))


def _add_bias(logits: torch.Tensor, rows: Sequence[RowSampling]) -> None:
    """``logit_bias`` values are added (ids outside the vocabulary ignored)."""
    vocab = logits.shape[1]
    pairs = [(i, t, v) for i, row in enumerate(rows) for t, v in row.logit_bias if 0 <= t < vocab]
    if not pairs:
        return
    row, tok, value = zip(*pairs)
    device = logits.device
    index = (torch.tensor(row, device=device), torch.tensor(tok, device=device))
    logits.index_put_(index, torch.tensor(value, dtype=logits.dtype, device=device), accumulate=True)


def filtered_probs(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks, as probabilities. logits: [rows, vocab]."""
    device = logits.device
    temperature = torch.tensor([r.temperature for r in rows], device=device).unsqueeze(1)
    logits = logits / temperature
    if all(r.top_k == 0 and r.top_p >= 1.0 and r.min_p == 0.0 for r in rows):
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=device).unsqueeze(1)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    remove = ranks >= top_k
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    top_p = torch.tensor([r.top_p for r in rows], device=device).unsqueeze(1)
    remove |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p  # NOTE: the top token always stays
    min_p = torch.tensor([r.min_p for r in rows], device=device).unsqueeze(1)
    remove |= sorted_probs < min_p * sorted_probs[:, :1]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    filtered = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)
