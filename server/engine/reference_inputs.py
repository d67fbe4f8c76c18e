"""The list-based reference of a step's arrays, built straight from the live sequences and the
block manager's tables, one token at a time.

The workers build steps from the id-keyed scheduler output in their persistent batch
(:mod:`pagedllm.server.worker.input_batch`); tests check that batch against this builder
step by step, and ``benchmarks/step_inputs.py`` times the two.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pagedllm.server.core.scheduler import ScheduledStep
from pagedllm.server.core.sequence import Sequence
from pagedllm.server.core.worker_view import Entry, split_step
from pagedllm.server.lora_request import LoRARequest
from pagedllm.server.worker.model_step import ModelStep, StepAttention, StepLoRA


def step_lora(out: ScheduledStep) -> StepLoRA | None:
    """The step's LoRA mapping, tokens in the step's order (decodes, proposal checks, prefill chunks);
    None without adapters."""
    if not out.lora_slots:
        return None
    decodes, verifies, prefills = split_step(out)
    slots, chunks = [], []
    adapters: dict[int, LoRARequest] = {}
    for group, _, chunk in decodes + verifies + prefills:
        lora = group.lora_request
        slot = out.lora_slots[lora.lora_int_id] if lora is not None else 0
        if lora is not None:
            adapters[slot] = lora
        slots.append(slot)
        chunks.append(chunk)
    token_slots = np.repeat(np.array(slots, dtype=np.int64), chunks)
    return StepLoRA(token_slots, tuple(sorted(adapters.items())))


def prepare_inputs(out: ScheduledStep, block_tables: Mapping[int, list[int]], block_size: int) -> ModelStep:
    """The step's arrays from Python lists: decodes first, then verifications, then prefill chunks."""
    decodes, verifies, prefills = split_step(out)
    entries = decodes + verifies + prefills
    tokens = _Tokens()
    tokens.add(entries, block_tables, block_size)
    meta = _metadata(decodes + verifies, prefills, block_tables, tokens.slots)
    sample_index, prompt_index, pool_index, pool_lens = _indices(entries)
    return ModelStep(
        list(out.blocks_to_swap_out),
        list(out.blocks_to_swap_in),
        list(out.blocks_to_copy),
        np.array(tokens.ids, dtype=np.int64),
        np.array(tokens.positions, dtype=np.int64),
        meta,
        sample_index,
        prompt_index,
        pool_index,
        pool_lens,
        step_lora(out),
    )


class _Tokens:
    """The list path: token ids, positions and cache slots of whole chunks, one token at a time."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []

    def add(self, entries: list[Entry], block_tables: Mapping[int, list[int]], block_size: int) -> None:
        for _, seq, chunk in entries:
            start = seq.num_computed_tokens
            table = block_tables[seq.seq_id]
            ids = seq.token_ids[start : start + chunk]
            if len(ids) < chunk:  # NOTE: proposals being verified follow the newest token
                ids = ids + seq.spec_token_ids[: chunk - len(ids)]
            self.ids.extend(ids)
            self.positions.extend(range(start, start + chunk))
            self.slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + chunk))


def _indices(entries: list[Entry]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Token indices of the sample rows then the verifications' rows, of the scored prompt
    positions (None: no request wants them) and of the pooled positions (with each row's count)."""
    sample_index: list[int] = []
    spec_index: list[int] = []
    prompt_index: list[int] = []
    prompt_rows = 0
    pool_index: list[int] = []
    pool_lens: list[int] = []
    offset = 0
    for group, seq, chunk in entries:
        start = seq.num_computed_tokens
        if group.pooling_params is not None:
            if group.pooling_params.reads_every_position:
                pool_index.extend(range(offset, offset + chunk))
                pool_lens.append(chunk)
            elif start + chunk == len(seq):
                pool_index.append(offset + chunk - 1)
                pool_lens.append(1)
        elif start + chunk == len(seq):
            sample_index.append(offset + chunk - 1)
        elif start + chunk > len(seq):
            drafts = len(seq.spec_token_ids)
            spec_index.extend(range(offset + chunk - 1 - drafts, offset + chunk))
        if group.sampling_params.prompt_logprobs is not None and start < len(seq.prompt_token_ids):
            prompt_rows += 1
            prompt_index.extend(
                offset + p - start for p in range(start, start + chunk) if p + 1 < len(seq.prompt_token_ids)
            )
        offset += chunk
    return (
        np.array(sample_index + spec_index, dtype=np.int64),
        np.array(prompt_index, dtype=np.int64) if prompt_rows else None,
        np.array(pool_index, dtype=np.int64) if pool_lens else None,
        np.array(pool_lens, dtype=np.int64) if pool_lens else None,
    )


def _metadata(decodes, prefills, block_tables, slots) -> StepAttention:
    decode_lens = _context_lens(decodes)
    return StepAttention(
        slot_mapping=np.array(slots, dtype=np.int64),
        num_decode_tokens=int(decode_lens.size),
        decode_block_tables=_tables(decodes, block_tables),
        decode_context_lens=decode_lens,
        prefill_block_tables=_tables(prefills, block_tables),
        prefill_cu_seqlens_q=_cu_seqlens(prefills),
        prefill_context_lens=_context_lens(prefills),
    )


def _tables(entries: list[Entry], block_tables: Mapping[int, list[int]]) -> np.ndarray:
    """One row per token of a verification (see :func:`_context_lens`), one per chunk otherwise."""
    if not entries:
        return np.zeros((0, 0), dtype=np.int32)
    rows = [block_tables[seq.seq_id] for _, seq, chunk in entries for _ in range(_decode_rows(seq, chunk))]
    width = max((len(r) for r in rows), default=0)
    padded = [r + [0] * (width - len(r)) for r in rows]
    return np.array(padded, dtype=np.int32).reshape(len(rows), width)


def _context_lens(entries: list[Entry]) -> np.ndarray:
    """Each chunk's context including its new tokens; a verification's tokens each as a decode of its own.

    NOTE: a sequence verifying k proposals attends as 1 + k decodes over the same block table,
    the i-th seeing ``num_computed + i + 1`` positions: causal attention within the chunk, on the
    decode kernels, in the batch with the step's other decodes::

        computed 0..9, chunk [t d0 d1] at 10..12   ->   decode rows: len 11, len 12, len 13
    """
    lens = []
    for _, seq, chunk in entries:
        start = seq.num_computed_tokens
        if _decode_rows(seq, chunk) == 1:
            lens.append(start + chunk)
        else:
            lens.extend(range(start + 1, start + chunk + 1))
    return np.array(lens, dtype=np.int32)


def _decode_rows(seq: Sequence, chunk: int) -> int:
    """Attention rows of a scheduled chunk: one per token when it verifies proposals, else one."""
    return chunk if seq.num_computed_tokens + chunk > len(seq.token_ids) else 1


def _cu_seqlens(prefills: list[Entry]) -> np.ndarray:
    cu = [0]
    for _, _, chunk in prefills:
        cu.append(cu[-1] + chunk)
    return np.array(cu, dtype=np.int32)
