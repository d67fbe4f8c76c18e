"""The persistent batch: decoding sequences' block tables and context lengths, kept across steps.

Rebuilding every block table from Python lists each step costs time proportional to the
whole batch's tables. Between two decode steps a table almost always either stays the
same or gains one block at its end, so the batch keeps one row per decoding sequence in
preallocated tensors and writes only what changed::

    row  seq   block_table [max_num_seqs, max_blocks_per_seq]   context_lens
     0    a    [ 7  3 12  0  0 ... ]                             10
     1    c    [ 4  9  0  0  0 ... ]                              6     <- c gained block 9: one write
     2    d    [ 5  0  0  0  0 ... ]                              2
    ---------------------------------------------------------------  rows past the step's decodes: stale
                 ^^^^^^^^ width handed to attention = widest row this step

    slot of the new token of row r = block_table[r, pos // B] * B + pos % B,  pos = context_lens[r] - 1

Rows follow the step's decode order (the scheduler's), so the step's tensors are exactly
those of the list-based builder (:func:`pagedllm.server.engine.step_inputs.prepare_inputs`).
A sequence keeps its row while it decodes step after step; when the step's decodes differ
from the rows (a sequence finished, was preempted or aborted, joined after its prefill,
was forked), the rows are compacted into the new order with one gather.

NOTE: the scheduler's order is kept rather than moving the last row into a hole, because
the order is visible: sample rows are drawn in it, and a seeded request with n > 1 draws
all its samples from one generator.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from pagedllm.server.core.sequence import Sequence


@dataclass
class DecodeInputs:
    """The decode part of one step (its first ``len(input_ids)`` tokens), as host arrays."""

    input_ids: np.ndarray  # [num_decodes] int64
    positions: np.ndarray  # [num_decodes] int64
    num_tokens: np.ndarray  # [num_decodes] int64: each sequence's length (it samples if position + 1 equals it)
    slot_mapping: np.ndarray  # [num_decodes] int64
    block_tables: np.ndarray  # [num_decodes, widest table] int32, a view of the persistent table
    context_lens: np.ndarray  # [num_decodes] int32, including the new token


class InputBatch:
    """One row per decoding sequence: its block table and context length, updated in place.

    NOTE (invariants, per row ``r < len(self.seq_ids)``):
    - ``block_table[r, :num_blocks[r]]`` equals the block manager's table of ``seq_ids[r]``
      as it was when its version was ``versions[r]``; entries past ``num_blocks[r]`` are 0;
    - a table whose version is unchanged has only grown at its end since (see
      ``BlockManager.table_versions``), so only its entries past ``num_blocks[r]`` are new.
    """

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        # NOTE: numpy, not tensors: element writes from Python cost ~0.1 us, not ~5 us.
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self.context_lens = np.zeros(max_num_seqs, dtype=np.int32)
        self._table = self.block_table
        self._lens = self.context_lens
        self.seq_ids: list[int] = []  # row -> sequence
        self._row_of: dict[int, int] = {}  # sequence -> row
        self.versions: list[int | None] = []  # row -> table version written (None: not yet)
        self.num_blocks: list[int] = []  # row -> table entries written

    def __len__(self) -> int:
        return len(self.seq_ids)

    def prepare(
        self, seqs: Seq[Sequence], block_tables: Mapping[int, list[int]], table_versions: Mapping[int, int]
    ) -> DecodeInputs:
        """Bring the rows up to date for this step's single-token sequences ``seqs`` (in step order).

        Each computes its token at ``seq.num_computed_tokens``. NOTE: the returned block
        table is a view of the persistent table: the next call writes into it, so the
        engine must finish this step's forward first (it runs one step at a time).
        """
        ids = [seq.seq_id for seq in seqs]
        if ids != self.seq_ids:
            self._reorder(ids)
        n = len(ids)
        starts = [seq.num_computed_tokens for seq in seqs]
        token_lists = [seq.token_ids for seq in seqs]
        tokens = [t[p] for t, p in zip(token_lists, starts)]
        width = self._sync_tables(block_tables, table_versions)
        positions = np.array(starts, dtype=np.int64)
        lens = self._lens[:n]
        lens[:] = positions + 1
        bs = self.block_size
        index, offsets = np.divmod(positions, bs)
        slots = self._table[np.arange(n), index].astype(np.int64) * bs + offsets
        return DecodeInputs(
            input_ids=np.array(tokens, dtype=np.int64),
            positions=positions,
            num_tokens=np.fromiter(map(len, token_lists), dtype=np.int64, count=n),
            slot_mapping=slots,
            block_tables=self._table[:n, :width],  # a view (see the NOTE above)
            context_lens=lens.copy(),
        )

    def _reorder(self, ids: list[int]) -> None:
        """Rows for ``ids`` in this order: kept rows move with one gather, new ones start empty."""
        if len(ids) > self.block_table.shape[0]:
            self._grow(rows=len(ids))
        sources = [self._row_of.get(seq_id, -1) for seq_id in ids]
        moves = [(dst, src) for dst, src in enumerate(sources) if src >= 0 and src != dst]
        if moves:
            dst_rows, src_rows = zip(*moves)
            # NOTE: fancy indexing on the right copies first, so overlapping moves are safe.
            self._table[list(dst_rows)] = self._table[list(src_rows)]
        self.versions = [self.versions[src] if src >= 0 else None for src in sources]
        self.num_blocks = [self.num_blocks[src] if src >= 0 else 0 for src in sources]
        self.seq_ids = list(ids)
        self._row_of = {seq_id: row for row, seq_id in enumerate(ids)}

    def _sync_tables(self, block_tables: Mapping[int, list[int]], table_versions: Mapping[int, int]) -> int:
        """Write what changed in each row's table since the last step; returns the widest table."""
        versions, written = self.versions, self.num_blocks
        for row, seq_id in enumerate(self.seq_ids):
            blocks = block_tables[seq_id]
            k, w = len(blocks), written[row]
            version = table_versions[seq_id]
            if k == w and version == versions[row]:
                continue  # NOTE: most rows, most steps: a block holds block_size decode steps
            if k > self._table.shape[1]:
                self._grow(cols=k)
            if version != versions[row] or k < w:
                self._table[row, :k] = blocks
                self._table[row, k:] = 0
                versions[row] = version
            elif k == w + 1:  # a new block at the end
                self._table[row, w] = blocks[w]
            else:
                self._table[row, w:k] = blocks[w:]
            written[row] = k
        return max(written, default=0)

    def _grow(self, rows: int = 0, cols: int = 0) -> None:
        """Larger tensors, contents kept (only if the engine's limits were exceeded; not on the hot path)."""
        old = self.block_table
        shape = (max(rows, old.shape[0]), max(cols, old.shape[1]))
        self.block_table = np.zeros(shape, dtype=np.int32)
        self.block_table[: old.shape[0], : old.shape[1]] = old
        lens = np.zeros(shape[0], dtype=np.int32)
        lens[: self.context_lens.shape[0]] = self.context_lens
        self.context_lens = lens
        self._table = self.block_table
        self._lens = self.context_lens
