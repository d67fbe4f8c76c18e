"""CUDA graphs of the model's forward for steps where every token is a decode.

A decode step of a 7B model launches over a thousand small kernels; on a GPU the host
issuing them, not the GPU running them, sets the step time until batches are large
(``benchmarks/gpu_step_profile.py``). A graph captured once per batch size replays them all
with one launch.

Graphs are captured for batch sizes 1, 2, 4, 8, then every multiple of 8 up to
``max_num_seqs`` (at most 512); a step of ``n`` decode rows replays the smallest graph of at
least ``n`` rows. The inputs live in static buffers that every graph reads: a step's rows
are copied in, and the padding rows write nowhere (slot -1: the KV write skips negative
slots) and attend to one cached token, their output unused. The decode kernel sizes its
grid from the block table's width (see ``choose_num_splits``), which is fixed here at
``max_model_len`` worth of blocks, so a replay never depends on a step's lengths.

Used only with the Triton attention backend (CUDA's default: its KV write skips negative
slots, and it needs no per-step plan on the host), on one rank, without LoRA (adapters
change per step). A model whose forward cannot be captured (a host sync inside it) runs
eagerly, with a warning; ``enforce_eager`` turns graphs off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pagedllm.server.worker.attention import AttentionMetadata, AttentionOps

logger = logging.getLogger(__name__)

MAX_CAPTURED_ROWS = 512

Forward = Callable[[torch.Tensor, torch.Tensor, list, AttentionMetadata, AttentionOps], torch.Tensor]


def capture_sizes(max_rows: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, 16, 24, ... up to ``max_rows``."""
    top = min(max_rows, MAX_CAPTURED_ROWS)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return [*sizes, top]


class DecodeGraphs:
    """One captured forward per batch size, over shared static input buffers."""

    def __init__(
        self,
        forward: Forward,
        kv_caches: list,
        ops: AttentionOps,
        max_rows: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.sizes = capture_sizes(max_rows)
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((top, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.context_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.sizes):  # NOTE: largest first; the smaller ones reuse its memory
            meta = self._meta(rows)
            forward(self.input_ids[:rows], self.positions[:rows], kv_caches, meta, ops)  # compiles, warms up
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[rows] = forward(self.input_ids[:rows], self.positions[:rows], kv_caches, meta, ops)
            self.graphs[rows] = graph
        torch.cuda.synchronize(device)

    def _meta(self, rows: int) -> AttentionMetadata:
        return AttentionMetadata.decodes(self.slot_mapping[:rows], self.block_tables[:rows], self.context_lens[:rows])

    def fits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether a graph can run this step: decodes only, no more rows than the largest graph."""
        rows = input_ids.numel()
        return (
            0 < rows <= self.sizes[-1]
            and meta.num_prefills == 0
            and meta.num_decode_tokens == rows
            and meta.decode_block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states of the step's rows: [rows, hidden], valid until the next run."""
        rows = input_ids.numel()
        size = next(s for s in self.sizes if s >= rows)
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.block_tables[:rows, :width].copy_(meta.decode_block_tables)
        self.context_lens[:rows].copy_(meta.decode_context_lens)
        if size > rows:  # NOTE: the padding rows of an earlier, larger step must write nowhere
            self.slot_mapping[rows:size].fill_(-1)
            self.context_lens[rows:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:rows]


def try_capture(
    forward: Forward, kv_caches: list, ops: AttentionOps, max_rows: int, max_blocks_per_seq: int, device: torch.device
) -> DecodeGraphs | None:
    """:class:`DecodeGraphs` for this model, or None (with a warning) where capture fails."""
    try:
        graphs = DecodeGraphs(forward, kv_caches, ops, max_rows, max_blocks_per_seq, device)
    except RuntimeError as exc:
        torch.cuda.synchronize(device)
        logger.warning("decode steps run eagerly: capturing a CUDA graph of the model failed (%s)", exc)
        return None
    logger.info("captured CUDA graphs of the decode step for %d batch sizes up to %d", len(graphs.sizes), max_rows)
    return graphs
