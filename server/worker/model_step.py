"""A step's arrays on a worker: plain numbers, no tensors.

The scheduler sends each rank an id-keyed :class:`~pagedllm.server.core.scheduler_output.SchedulerOutput`;
the rank's persistent batch (:mod:`pagedllm.server.worker.input_batch`) applies its diffs and
builds the step's :class:`ModelStep` of numpy arrays: token ids, positions, cache slots, block
ids and row indices. The worker then makes them tensors on its own device
(:mod:`pagedllm.server.worker.device_step`), runs them, samples on that device and returns
tokens (:class:`StepOutputs`), never logits.

NOTE: this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pagedllm.server.lora_request import LoRARequest
from pagedllm.server.worker.sampling_batch import SamplerOutput, SamplingBatch


@dataclass(frozen=True)
class StepLoRA:
    """What every rank needs to run a step's adapters (sent with the step to the other ranks)."""

    token_slots: np.ndarray  # [num_tokens] int64, 0 for base-model tokens
    adapters: tuple[tuple[int, LoRARequest], ...]
    """(slot, adapter) of every slot the step uses; a rank loads one whose slot holds another."""


@dataclass
class StepAttention:
    """Where one step's tokens go in the KV cache and what each query attends to, as host arrays.

    The worker's :class:`~pagedllm.server.worker.attention.AttentionMetadata` has the same fields as tensors.
    """

    slot_mapping: np.ndarray  # [num_tokens] int64: block * block_size + offset
    num_decode_tokens: int  # the first num_decode_tokens tokens are single-token decodes
    decode_block_tables: np.ndarray  # [num_decodes, max_blocks] int32
    decode_context_lens: np.ndarray  # [num_decodes] int32, including the new token
    prefill_block_tables: np.ndarray  # [num_prefills, max_blocks] int32
    prefill_cu_seqlens_q: np.ndarray  # [num_prefills + 1] int32
    prefill_context_lens: np.ndarray  # [num_prefills] int32, including the new tokens

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_context_lens.size)


ARRAY_FIELDS = (
    "slot_mapping",
    "decode_block_tables",
    "decode_context_lens",
    "prefill_block_tables",
    "prefill_cu_seqlens_q",
    "prefill_context_lens",
)
"""The array fields of :class:`StepAttention` (those that become tensors on a worker)."""


class StepOutputs(NamedTuple):
    """What a step returns to the engine."""

    sampled: SamplerOutput | None
    """Tokens and asked log-probabilities of the step's sampling (None: nothing sampled, or not the driver)."""
    pooled: np.ndarray | None
    """[pool rows, hidden] float32 sums, or None without embedding requests."""


class LaunchedStep(NamedTuple):
    """A step whose work is queued on the device and whose tokens are on their way to the host
    (``async_scheduling``): :meth:`outputs` waits for them. On a CPU the work has already run."""

    read: Callable[[], SamplerOutput | None]
    """Waits for the read-back; the step's sampling as :attr:`StepOutputs.sampled`."""
    pooled: np.ndarray | None

    def outputs(self) -> StepOutputs:
        return StepOutputs(self.read(), self.pooled)


@dataclass
class ModelStep:
    """One step's arrays on one rank, built by its input batch (every rank builds the same)."""

    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copies: list[tuple[int, int]]
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    meta: StepAttention
    sample_index: np.ndarray  # [rows] int64: token index of each logits row
    prompt_index: np.ndarray | None  # [positions scored] int64, None without prompt logprobs
    pool_index: np.ndarray | None = None
    """[tokens pooled] the step's token indices whose hidden states are summed, row after row."""
    pool_lens: np.ndarray | None = None
    """[pool rows] how many of ``pool_index`` each row sums."""
    lora: StepLoRA | None = None
    """Each token's LoRA slot and the adapters the step needs resident; None: the base model alone."""
    sampling: SamplingBatch | None = None
    """How the rows of ``sample_index`` and ``prompt_index`` become tokens; only the driver gets it."""
    placeholders: tuple[np.ndarray, np.ndarray] | None = None
    """(token indices, sample rows): ``input_ids`` at those indices are placeholders for the ids
    the previous step sampled in those rows (``async_scheduling``); None: none."""
