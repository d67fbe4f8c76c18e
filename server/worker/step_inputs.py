"""One step's inputs: the scheduled tokens flattened into tensors, and the rows whose logits matter."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.server.core.scheduler import SchedulerOutput
from pagedllm.server.core.sequence import Sequence, SequenceGroup
from pagedllm.server.worker.attention import TENSOR_FIELDS, AttentionMetadata


@dataclass
class SampleRow:
    """A row of the step's logits: the sequence it belongs to and what it is for."""

    group: SequenceGroup
    seq: Sequence
    prompt_positions: list[int] = field(default_factory=list)  # prompt logprob rows: token indices scored


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_rows: list[SampleRow]  # sequences that reach their end and sample a token
    sample_index: torch.Tensor  # [len(sample_rows)] token index of each row's last token
    prompt_rows: list[SampleRow]  # sequences that want prompt logprobs for this chunk
    prompt_index: torch.Tensor  # [sum of their positions] token indices whose logits score the prompt


@dataclass
class ModelStep:
    """What every tensor-parallel rank needs to run one step (the driver sends it to the others)."""

    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copies: list[tuple[int, int]]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: torch.Tensor
    prompt_index: torch.Tensor | None

    def to_wire(self) -> tuple:
        """A by-value form for the pipe to the other ranks (numpy arrays: no shared-memory handles)."""
        meta = {name: _plain(getattr(self.meta, name)) for name in (*TENSOR_FIELDS, "num_decode_tokens")}
        return (
            self.swap_out,
            self.swap_in,
            self.copies,
            _plain(self.input_ids),
            _plain(self.positions),
            meta,
            _plain(self.sample_index),
            _plain(self.prompt_index),
        )

    @classmethod
    def from_wire(cls, wire: tuple) -> ModelStep:
        swap_out, swap_in, copies, ids, positions, meta, sample_index, prompt_index = wire
        tensors = {name: _tensor(value) for name, value in meta.items()}
        return cls(
            swap_out,
            swap_in,
            copies,
            _tensor(ids),
            _tensor(positions),
            AttentionMetadata(**tensors),
            _tensor(sample_index),
            _tensor(prompt_index),
        )

    def to(self, device: torch.device) -> ModelStep:
        moved = {name: getattr(self.meta, name).to(device) for name in TENSOR_FIELDS}
        meta = dataclasses.replace(self.meta, plan=None, **moved)
        index = self.prompt_index.to(device) if self.prompt_index is not None else None
        return dataclasses.replace(
            self,
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            meta=meta,
            sample_index=self.sample_index.to(device),
            prompt_index=index,
        )


def _plain(value: Any) -> Any:
    return value.cpu().numpy() if isinstance(value, torch.Tensor) else value


def _tensor(value: Any) -> Any:
    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value


@dataclass
class StepResult:
    inputs: StepInputs
    logits: torch.Tensor  # [len(inputs.sample_rows), vocab] float32
    prompt_logits: torch.Tensor | None  # [len(inputs.prompt_index), vocab] float32


def prepare_inputs(
    out: SchedulerOutput, block_tables: dict[int, list[int]], block_size: int, device: torch.device
) -> StepInputs:
    """Flatten the step: decodes first, then prefill chunks (see attention.py)."""
    decodes: list[tuple[SequenceGroup, Sequence, int]] = []
    prefills: list[tuple[SequenceGroup, Sequence, int]] = []
    for item in out.scheduled:
        for seq in item.group.seqs:
            chunk = item.chunks.get(seq.seq_id)
            if chunk:
                (decodes if chunk == 1 else prefills).append((item.group, seq, chunk))
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[SampleRow] = []
    sample_index: list[int] = []
    prompt_rows: list[SampleRow] = []
    prompt_index: list[int] = []
    for group, seq, chunk in decodes + prefills:
        start = seq.num_computed_tokens
        table = block_tables[seq.seq_id]
        tokens = seq.token_ids
        offset = len(ids)
        ids.extend(tokens[start : start + chunk])
        positions.extend(range(start, start + chunk))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + chunk))
        if start + chunk == len(seq):
            sample_rows.append(SampleRow(group, seq))
            sample_index.append(offset + chunk - 1)
        if group.sampling_params.prompt_logprobs is not None and start < len(seq.prompt_token_ids):
            scored = [p for p in range(start, start + chunk) if p + 1 < len(seq.prompt_token_ids)]
            prompt_rows.append(SampleRow(group, seq, [p + 1 for p in scored]))
            prompt_index.extend(offset + p - start for p in scored)
    meta = _metadata(decodes, prefills, block_tables, slots, device)
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        meta=meta,
        sample_rows=sample_rows,
        sample_index=torch.tensor(sample_index, dtype=torch.int64, device=device),
        prompt_rows=prompt_rows,
        prompt_index=torch.tensor(prompt_index, dtype=torch.int64, device=device),
    )


def _metadata(decodes, prefills, block_tables, slots, device: torch.device) -> AttentionMetadata:
    def tables(entries):
        rows = [block_tables[seq.seq_id] for _, seq, _ in entries]
        width = max((len(r) for r in rows), default=0)
        padded = [r + [0] * (width - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.int32, device=device).view(len(rows), width)

    def context_lens(entries):
        return torch.tensor(
            [seq.num_computed_tokens + chunk for _, seq, chunk in entries], dtype=torch.int32, device=device
        )

    cu = [0]
    for _, _, chunk in prefills:
        cu.append(cu[-1] + chunk)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decode_tokens=len(decodes),
        decode_block_tables=tables(decodes),
        decode_context_lens=context_lens(decodes),
        prefill_block_tables=tables(prefills),
        prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        prefill_context_lens=context_lens(prefills),
    )
