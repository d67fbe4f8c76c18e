"""A :class:`~pagedllm.server.worker.model_step.ModelStep` on a worker's device: its arrays as tensors.

The engine sends host arrays; each worker makes them tensors here, once per step, on its
own device (on the CPU the tensors share the arrays' memory). With ``pinned`` (CUDA with
``async_scheduling``) each array is staged in page-locked memory and copied without blocking
the host, so the step's copies queue on the stream behind the step before.
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
    def of(cls, step: ModelStep, device: torch.device, pinned: bool = False) -> DeviceStep:
        pinned = pinned and device.type == "cuda"
        return cls(
            step.swap_out,
            step.swap_in,
            step.copies,
            _tensor(step.input_ids, device, pinned),
            _tensor(step.positions, device, pinned),
            attention_metadata(step.meta, device, pinned),
            _tensor(step.sample_index, device, pinned),
            _optional(step.prompt_index, device, pinned),
            _optional(step.pool_index, device, pinned),
            _optional(step.pool_lens, device, pinned),
            step.lora,
            step.sampling,
        )


def attention_metadata(meta: StepAttention, device: torch.device, pinned: bool = False) -> AttentionMetadata:
    """The step's attention arrays as tensors on ``device``."""
    return AttentionMetadata(
        slot_mapping=_tensor(meta.slot_mapping, device, pinned),
        num_decode_tokens=meta.num_decode_tokens,
        decode_block_tables=_tensor(meta.decode_block_tables, device, pinned),
        decode_context_lens=_tensor(meta.decode_context_lens, device, pinned),
        prefill_block_tables=_tensor(meta.prefill_block_tables, device, pinned),
        prefill_cu_seqlens_q=_tensor(meta.prefill_cu_seqlens_q, device, pinned),
        prefill_context_lens=_tensor(meta.prefill_context_lens, device, pinned),
    )


def fill_placeholders(
    input_ids: torch.Tensor,
    placeholders: tuple[np.ndarray, np.ndarray],
    sampled: torch.Tensor | None,
    pinned: bool = False,
) -> None:
    """Put the ids the previous step sampled (``sampled``, one per sample row, on the device) where the
    step has placeholders, without the ids passing through the host."""
    if sampled is None:
        raise RuntimeError("the step has placeholder tokens but the step before sampled nothing here")
    holes, rows = placeholders
    device = input_ids.device
    pinned = pinned and device.type == "cuda"
    input_ids[_tensor(holes, device, pinned)] = sampled[_tensor(rows, device, pinned)]


def _tensor(value: np.ndarray, device: torch.device, pinned: bool = False) -> torch.Tensor:
    if pinned and value.size:
        # NOTE: a fresh page-locked copy per step: the caching host allocator keeps it until its
        # copy has run, so a step launched ahead never overwrites what the one before still reads.
        return torch.from_numpy(value).pin_memory().to(device, non_blocking=True)
    return torch.from_numpy(value).to(device)


def _optional(value: np.ndarray | None, device: torch.device, pinned: bool = False) -> torch.Tensor | None:
    return _tensor(value, device, pinned) if value is not None else None
