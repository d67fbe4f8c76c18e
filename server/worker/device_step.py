"""A :class:`~pagedllm.server.worker.model_step.ModelStep` on a worker's device: its arrays as tensors.

The engine sends host arrays; each worker makes them tensors here, once per step, on its
own device (on the CPU the tensors share the arrays' memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.server.worker.attention import AttentionMetadata
from pagedllm.server.worker.model_step import ModelStep, StepAttention, StepLoRA
from pagedllm.server.worker.sampling_batch import SamplingBatch


@dataclass
class DeviceStep:
    """The tensors of one step on one device (see :class:`ModelStep` for each field)."""

    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copies: list[tuple[int, int]]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: torch.Tensor
    prompt_index: torch.Tensor | None
    pool_index: torch.Tensor | None
    pool_lens: torch.Tensor | None
    lora: StepLoRA | None
    sampling: SamplingBatch | None

    @classmethod
    def of(cls, step: ModelStep, device: torch.device) -> DeviceStep:
        return cls(
            step.swap_out,
            step.swap_in,
            step.copies,
            _tensor(step.input_ids, device),
            _tensor(step.positions, device),
            attention_metadata(step.meta, device),
            _tensor(step.sample_index, device),
            _optional(step.prompt_index, device),
            _optional(step.pool_index, device),
            _optional(step.pool_lens, device),
            step.lora,
            step.sampling,
        )


def attention_metadata(meta: StepAttention, device: torch.device) -> AttentionMetadata:
    """The step's attention arrays as tensors on ``device``."""
    return AttentionMetadata(
        slot_mapping=_tensor(meta.slot_mapping, device),
        num_decode_tokens=meta.num_decode_tokens,
        decode_block_tables=_tensor(meta.decode_block_tables, device),
        decode_context_lens=_tensor(meta.decode_context_lens, device),
        prefill_block_tables=_tensor(meta.prefill_block_tables, device),
        prefill_cu_seqlens_q=_tensor(meta.prefill_cu_seqlens_q, device),
        prefill_context_lens=_tensor(meta.prefill_context_lens, device),
    )


def _tensor(value: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(value).to(device)


def _optional(value: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    return _tensor(value, device) if value is not None else None
