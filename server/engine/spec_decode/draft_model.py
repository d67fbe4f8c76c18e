"""The draft model of ``draft_model`` speculation, as the engine sees it: what the draft's
cache holds per sequence (:class:`DraftState`) and the handle that runs it (:class:`DraftModel`).

The draft's cache has as many blocks as the target's, and a sequence's K/V for the draft
sits in the same block ids and slots as for the target, so the block manager's one table
serves both and nothing else tracks the draft's memory. What the draft needs is that its
K/V of a sequence is current; :class:`DraftState` says up to which position it is, and
which blocks held it. Whenever the sequence's table no longer starts with those blocks
(recomputation, a swap, copy-on-write), the draft computes the sequence again from the
start. A stale draft cache could only cost acceptance, never output: the target verifies
every proposal.

The draft itself (weights, cache, forward passes) lives on the driver's worker
(:class:`~pagedllm.server.worker.draft_runner.DraftRunner`); the executor starts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class DraftState:
    """How much of one sequence the draft's cache holds."""

    computed: int = 0
    """Positions [0, computed) have the draft's K/V."""
    blocks: tuple[int, ...] = ()
    """The sequence's block table when the draft last wrote, covering at least ``computed``."""

    def valid_prefix(self, table: list[int], block_size: int) -> int:
        """Positions still valid: ``computed`` if the table still starts with those blocks, else 0."""
        used = -(-self.computed // block_size)
        return self.computed if tuple(table[:used]) == self.blocks[:used] else 0


class DraftModel(Protocol):
    """The engine's handle on the draft: its path, block size and batched greedy tokens."""

    path: str
    block_size: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the draft's cache (it takes its share of the device memory)."""
        ...

    def allocate(self, num_blocks: int) -> None:
        """The draft's cache: as many blocks as the target's device cache."""
        ...

    def shutdown(self) -> None: ...

    def next_tokens(self, chunks: list[tuple[list[int], int, list[int]]]) -> list[int]:
        """The draft's greedy token after each chunk (token ids, position of the first, block table),
        writing the chunks' K/V into its cache."""
        ...
