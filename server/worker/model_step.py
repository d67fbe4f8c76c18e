"""The worker's step message: everything a rank needs to run one step, tensors built by the engine.

The engine turns a :class:`~pagedllm.server.core.scheduler.SchedulerOutput` into a
:class:`ModelStep` (:mod:`pagedllm.server.engine.step_inputs`); the worker runs it, samples on
its device and returns tokens (:class:`StepOutputs`), never logits. The worker never reads a
scheduler output, a sequence or a block table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from pagedllm.server.worker.attention import TENSOR_FIELDS, AttentionMetadata
from pagedllm.server.worker.sampling_batch import SamplerOutput, SamplingBatch

if TYPE_CHECKING:
    from pagedllm.server.worker.lora_model import StepLoRA


class StepOutputs(NamedTuple):
    """What a step returns to the engine."""

    sampled: SamplerOutput | None
    """Tokens and asked log-probabilities of the step's sampling (None: nothing sampled, or not the driver)."""
    pooled: torch.Tensor | None
    """[pool rows, hidden] float32 sums on the CPU, or None without embedding requests."""


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
    pool_index: torch.Tensor | None = None
    """[tokens pooled] the step's token indices whose hidden states are summed, row after row."""
    pool_lens: torch.Tensor | None = None
    """[pool rows] how many of ``pool_index`` each row sums."""
    lora: StepLoRA | None = None
    """Each token's LoRA slot and the adapters the step needs resident; None: the base model alone."""
    sampling: SamplingBatch | None = None
    """How the rows of ``sample_index`` and ``prompt_index`` become tokens; only the driver gets it."""

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
            _plain(self.pool_index),
            _plain(self.pool_lens),
            self.lora,
            self.sampling,
        )

    @classmethod
    def from_wire(cls, wire: tuple) -> ModelStep:
        (
            swap_out,
            swap_in,
            copies,
            ids,
            positions,
            meta,
            sample_index,
            prompt_index,
            pool_index,
            pool_lens,
            lora,
            sampling,
        ) = wire
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
            _tensor(pool_index),
            _tensor(pool_lens),
            lora,
            sampling,
        )

    def to(self, device: torch.device) -> ModelStep:
        moved = {name: getattr(self.meta, name).to(device) for name in TENSOR_FIELDS}
        meta = dataclasses.replace(self.meta, plan=None, **moved)
        return dataclasses.replace(
            self,
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            meta=meta,
            sample_index=self.sample_index.to(device),
            prompt_index=_to(self.prompt_index, device),
            pool_index=_to(self.pool_index, device),
            pool_lens=_to(self.pool_lens, device),
        )


def _to(value: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return value.to(device) if value is not None else None


def _plain(value: Any) -> Any:
    return value.cpu().numpy() if isinstance(value, torch.Tensor) else value


def _tensor(value: Any) -> Any:
    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value
