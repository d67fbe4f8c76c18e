"""Every Triton kernel of the model compiled at start-up, before the server reports ready.

Triton compiles a kernel at its first launch for each combination of its compile-time
constants and of its integer arguments' classes (1, a multiple of 16, any other); a step
that meets a new combination stalls for the compile (hundreds of milliseconds) inside its
timed window. The kernels keep what varies from step to step out of that key where it
costs nothing (``do_not_specialize``: block-table widths, split and sequence counts); what
is left is covered by running the model once on each shape class serving meets::

    decode steps of every batch size the CUDA graphs capture (1, 2, 4, 8, 16, 24, ...: rows
    that are 1, multiples of 16 and others), each with a one-block and a full-width block
    table (no split / split-KV decode), then one prefill chunk of the step's token budget

The steps write nowhere (slot -1: the Triton KV write skips it) and attend to garbage
(table entries 0, one cached token), their outputs unused. With CUDA graphs the capture
that follows replays the same shapes, compiling nothing more.

NOTE: kernels only a LoRA adapter or the draft model reaches are not warmed here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.server.worker.attention import AttentionMetadata, AttentionOps
from pagedllm.server.worker.cuda_graphs import capture_sizes

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, list, AttentionMetadata, AttentionOps], torch.Tensor]


@dataclass(frozen=True)
class WarmupShapes:
    """The step shapes serving will use: decode rows up to ``max_rows``, prefill chunks up to
    ``prefill_tokens``, block tables up to ``max_blocks`` wide."""

    max_rows: int
    prefill_tokens: int
    max_blocks: int

    def decode_steps(self) -> list[tuple[int, int]]:
        """(rows, block-table width) of each decode step, largest first (kept buffers sized once)."""
        widths = sorted({self.max_blocks, 1}, reverse=True)
        return [(rows, width) for rows in reversed(capture_sizes(self.max_rows)) for width in widths]


def decode_meta(rows: int, width: int, device: torch.device) -> AttentionMetadata:
    """A decode step of ``rows`` rows that writes nowhere and reads one cached token each."""
    return AttentionMetadata.decodes(
        torch.full((rows,), -1, dtype=torch.int64, device=device),
        torch.zeros((rows, width), dtype=torch.int32, device=device),
        torch.ones(rows, dtype=torch.int32, device=device),
    )


def prefill_meta(tokens: int, width: int, device: torch.device) -> AttentionMetadata:
    """One prompt chunk of ``tokens`` tokens that writes nowhere (its keys: whatever block 0 holds)."""
    return AttentionMetadata.prefills(
        torch.full((tokens,), -1, dtype=torch.int64, device=device),
        torch.zeros((1, width), dtype=torch.int32, device=device),
        torch.tensor([0, tokens], dtype=torch.int32, device=device),
        torch.tensor([tokens], dtype=torch.int32, device=device),
    )


@torch.inference_mode()
def warm_up(forward: Forward, kv_caches: list, ops: AttentionOps, shapes: WarmupShapes, device: torch.device) -> int:
    """Run ``forward`` on every shape of ``shapes`` (compiling its Triton kernels); how many steps ran."""
    start = time.perf_counter()
    steps = [decode_meta(rows, width, device) for rows, width in shapes.decode_steps()]
    block_size = kv_caches[0][0].shape[1]
    tokens = max(1, min(shapes.prefill_tokens, shapes.max_blocks * block_size))  # NOTE: within the table
    steps.append(prefill_meta(tokens, -(-tokens // block_size), device))
    for meta in steps:
        rows = meta.slot_mapping.numel()
        ids = torch.zeros(rows, dtype=torch.int64, device=device)
        forward(ids, torch.zeros(rows, dtype=torch.int64, device=device), kv_caches, meta, ops)
    # NOTE: block 0 onto itself: the same values written back (copy-on-write's kernel, compiled)
    ops.copy_blocks(
        [k for k, _ in kv_caches], [v for _, v in kv_caches], torch.zeros((1, 2), dtype=torch.int64, device=device)
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("Triton kernels warmed up on %d step shapes in %.1f s", len(steps), time.perf_counter() - start)
    return len(steps)
