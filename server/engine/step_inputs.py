"""One step's inputs, built on the engine side: the scheduled tokens flattened into host arrays,
the rows whose logits matter, and the :class:`~pagedllm.server.worker.model_step.ModelStep` the workers run.

    SchedulerOutput + block tables ─► StepBuilder.build ─┬► StepInputs (which sequence each logits row is)
                                                         └► ModelStep (arrays) ─► Executor.execute
                                                                                  └► StepOutputs (tokens)

NOTE: numbers only (numpy): each worker makes its tensors on its own device
(:mod:`pagedllm.server.worker.device_step`), so the engine imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.server.core.scheduler import SchedulerOutput
from pagedllm.server.core.sequence import Sequence, SequenceGroup
from pagedllm.server.engine.input_batch import DecodeInputs, InputBatch
from pagedllm.server.lora_request import LoRARequest
from pagedllm.server.worker.model_step import ModelStep, StepAttention, StepLoRA, StepOutputs
from pagedllm.server.worker.sampling_batch import SamplerOutput


@dataclass
class SampleRow:
    """A row of the step's logits: the sequence it belongs to and what it is for."""

    group: SequenceGroup
    seq: Sequence
    prompt_positions: list[int] = field(default_factory=list)  # prompt logprob rows: token indices scored


@dataclass
class PoolRow:
    """A row of the step's pooled hidden states: the sum over ``num`` prompt positions from ``start``."""

    group: SequenceGroup
    seq: Sequence
    start: int
    num: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.num == len(self.seq)


@dataclass
class SpecRow:
    """A sequence verifying proposals: its logits are ``1 + len(draft_token_ids)`` rows, one per
    position from its newest token on (speculative decoding)."""

    group: SequenceGroup
    seq: Sequence
    draft_token_ids: list[int]


@dataclass
class StepInputs:
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    meta: StepAttention
    sample_rows: list[SampleRow]  # sequences that reach their end and sample a token
    sample_index: np.ndarray  # [len(sample_rows)] token index of each row's last token
    prompt_rows: list[SampleRow]  # sequences that want prompt logprobs for this chunk
    prompt_index: np.ndarray  # [sum of their positions] token indices whose logits score the prompt
    pool_rows: list[PoolRow] = field(default_factory=list)  # embedding requests' positions pooled this step
    pool_index: np.ndarray | None = None  # [sum of their num] token indices pooled, row after row
    spec_rows: list[SpecRow] = field(default_factory=list)
    """Sequences verifying proposals; their logits rows follow the sample rows' in ``sample_index``."""


@dataclass
class StepResult:
    """A step's rows and the worker's outputs for them (see :class:`StepOutputs`)."""

    inputs: StepInputs
    sampled: SamplerOutput | None
    """Tokens of the sample rows, verified proposals and prompt log-probabilities (None: no sampling)."""
    pooled: np.ndarray | None = None  # [len(inputs.pool_rows), hidden] float32 sums

    @classmethod
    def of(cls, inputs: StepInputs, outputs: StepOutputs) -> StepResult:
        return cls(inputs, outputs.sampled, outputs.pooled)


Entry = tuple[SequenceGroup, Sequence, int]
"""A sequence in the step and how many new tokens it computes."""


class StepBuilder:
    """Turns the scheduler's step into the worker's :class:`ModelStep`, keeping the decodes'
    persistent :class:`InputBatch` across steps.

    NOTE: the step's decode block table is a view of :attr:`batch`, which the next
    :meth:`build` updates in place: a step must be done with its inputs before the next one
    is built (the engine runs one at a time).
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, lora: bool):
        self.batch = InputBatch(max_num_seqs, -(-max_model_len // block_size), block_size)
        self.lora = lora
        """Whether the model has adapter hooks (then every step carries its token slots)."""

    def build(
        self, out: SchedulerOutput, block_tables: Mapping[int, list[int]], table_versions: Mapping[int, int]
    ) -> tuple[StepInputs, ModelStep]:
        """The step's rows and the tensors the worker runs (``block_tables`` and ``table_versions``
        are the block manager's: see ``BlockManager.table_versions``)."""
        inputs = prepare_batched_inputs(out, self.batch, block_tables, table_versions)
        step = ModelStep(
            out.blocks_to_swap_out,
            out.blocks_to_swap_in,
            out.blocks_to_copy,
            inputs.input_ids,
            inputs.positions,
            inputs.meta,
            inputs.sample_index,
            inputs.prompt_index if inputs.prompt_rows else None,
            inputs.pool_index,
            np.array([row.num for row in inputs.pool_rows], dtype=np.int64) if inputs.pool_rows else None,
            step_lora(out) if self.lora else None,
        )
        return inputs, step


def split_step(out: SchedulerOutput) -> tuple[list[Entry], list[Entry], list[Entry]]:
    """The step's single-token sequences, its sequences verifying proposals and its longer chunks,
    each in scheduled order."""
    decodes: list[Entry] = []
    verifies: list[Entry] = []
    prefills: list[Entry] = []
    for item in out.scheduled:
        for seq in item.group.seqs:
            chunk = item.chunks.get(seq.seq_id)
            if not chunk:
                continue
            if chunk == 1:
                decodes.append((item.group, seq, chunk))
            elif seq.num_computed_tokens + chunk > len(seq.token_ids):
                verifies.append((item.group, seq, chunk))
            else:
                prefills.append((item.group, seq, chunk))
    return decodes, verifies, prefills


def step_lora(out: SchedulerOutput) -> StepLoRA | None:
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


def prepare_inputs(out: SchedulerOutput, block_tables: dict[int, list[int]], block_size: int) -> StepInputs:
    """Flatten the step from Python lists: decodes first, then verifications, then prefill chunks.

    The engine keeps decodes in an :class:`~pagedllm.server.engine.input_batch.InputBatch`
    (:func:`prepare_batched_inputs`); this builder is the reference it is tested against.
    """
    decodes, verifies, prefills = split_step(out)
    entries = decodes + verifies + prefills
    tokens = _Tokens()
    tokens.add(entries, block_tables, block_size)
    meta = _metadata(decodes + verifies, prefills, block_tables, tokens.slots)
    return _step_inputs(entries, tokens.ids, tokens.positions, meta)


def prepare_batched_inputs(
    out: SchedulerOutput,
    batch: InputBatch,
    block_tables: Mapping[int, list[int]],
    table_versions: Mapping[int, int],
) -> StepInputs:
    """The same step as :func:`prepare_inputs`, its decodes taken from the persistent ``batch``."""
    decodes, verifies, prefills = split_step(out)
    rows = batch.prepare([seq for _, seq, _ in decodes], block_tables, table_versions)
    ids, positions, slots = rows.input_ids, rows.positions, rows.slot_mapping
    decode_tables, decode_lens = rows.block_tables, rows.context_lens
    if verifies or prefills:
        tokens = _Tokens()
        tokens.add(verifies + prefills, block_tables, batch.block_size)
        ids = np.concatenate((ids, np.array(tokens.ids, dtype=np.int64)))
        positions = np.concatenate((positions, np.array(tokens.positions, dtype=np.int64)))
        slots = np.concatenate((slots, np.array(tokens.slots, dtype=np.int64)))
    if verifies:
        decode_tables = _stack(decode_tables, _tables(verifies, block_tables))
        decode_lens = np.concatenate((decode_lens, _context_lens(verifies)))
    meta = StepAttention(
        slot_mapping=slots,
        num_decode_tokens=int(decode_lens.size),
        decode_block_tables=decode_tables,
        decode_context_lens=decode_lens,
        prefill_block_tables=_tables(prefills, block_tables),
        prefill_cu_seqlens_q=_cu_seqlens(prefills),
        prefill_context_lens=_context_lens(prefills),
    )
    if verifies or prefills or not _plain_decodes(decodes, rows):
        entries = decodes + verifies + prefills
        return _step_inputs(entries, ids, positions, meta)
    return StepInputs(  # every row samples its one token and none scores its prompt: the usual step
        input_ids=ids,
        positions=positions,
        meta=meta,
        sample_rows=[SampleRow(group, seq) for group, seq, _ in decodes],
        sample_index=np.arange(len(decodes), dtype=np.int64),
        prompt_rows=[],
        prompt_index=np.zeros(0, dtype=np.int64),
    )


def _stack(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Block-table rows of ``first`` then ``second``, zero-padded to the wider (int32)."""
    width = max(first.shape[1], second.shape[1])
    out = np.zeros((first.shape[0] + second.shape[0], width), dtype=np.int32)
    out[: first.shape[0], : first.shape[1]] = first
    out[first.shape[0] :, : second.shape[1]] = second
    return out


def _plain_decodes(decodes: list[Entry], rows: DecodeInputs) -> bool:
    """Whether every decode samples (its token is its last), none wants prompt logprobs and none is pooled."""
    if not (rows.positions + 1 == rows.num_tokens).all():
        return False
    return all(
        group.sampling_params.prompt_logprobs is None and group.pooling_params is None for group, _, _ in decodes
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


def _step_inputs(entries: list[Entry], ids: Any, positions: Any, meta: StepAttention) -> StepInputs:
    """The rows whose logits the step needs, around the step's tokens (``entries`` in token order)."""
    sample_rows: list[SampleRow] = []
    sample_index: list[int] = []
    prompt_rows: list[SampleRow] = []
    prompt_index: list[int] = []
    pool_rows: list[PoolRow] = []
    pool_index: list[int] = []
    spec_rows: list[SpecRow] = []
    spec_index: list[int] = []
    offset = 0
    for group, seq, chunk in entries:
        start = seq.num_computed_tokens
        if group.pooling_params is not None:
            row = _pool_row(group, seq, start, chunk)
            if row is not None:
                pool_rows.append(row)
                pool_index.extend(range(offset + row.start - start, offset + row.start - start + row.num))
        elif start + chunk == len(seq):
            sample_rows.append(SampleRow(group, seq))
            sample_index.append(offset + chunk - 1)
        elif start + chunk > len(seq):
            drafts = list(seq.spec_token_ids)
            spec_rows.append(SpecRow(group, seq, drafts))
            spec_index.extend(range(offset + chunk - 1 - len(drafts), offset + chunk))
        if group.sampling_params.prompt_logprobs is not None and start < len(seq.prompt_token_ids):
            scored = [p for p in range(start, start + chunk) if p + 1 < len(seq.prompt_token_ids)]
            prompt_rows.append(SampleRow(group, seq, [p + 1 for p in scored]))
            prompt_index.extend(offset + p - start for p in scored)
        offset += chunk
    return StepInputs(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=np.asarray(positions, dtype=np.int64),
        meta=meta,
        sample_rows=sample_rows,
        sample_index=np.array(sample_index + spec_index, dtype=np.int64),
        prompt_rows=prompt_rows,
        prompt_index=np.array(prompt_index, dtype=np.int64),
        pool_rows=pool_rows,
        pool_index=np.array(pool_index, dtype=np.int64) if pool_rows else None,
        spec_rows=spec_rows,
    )


def _pool_row(group: SequenceGroup, seq: Sequence, start: int, chunk: int) -> PoolRow | None:
    """The positions of this chunk an embedding request pools: all of them (mean), or the last prompt token."""
    assert group.pooling_params is not None
    if group.pooling_params.reads_every_position:
        return PoolRow(group, seq, start, chunk)
    return PoolRow(group, seq, len(seq) - 1, 1) if start + chunk == len(seq) else None


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
