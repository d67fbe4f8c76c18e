"""The engine with block sharing disabled: every sequence owns a copy of its blocks.

The paper's Fig. 14 baseline for parallel sampling and beam search. A forked sequence
first shares its parent's blocks as usual; at its next step it copies every block it
still shares (the prompt's and the generated ones), through the same room check as any
other allocation, so a group with k sequences holds k full copies from then on.
"""

from __future__ import annotations

from pagedllm.server.core.block_manager import AllocStatus, BlockManager
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.engine.llm_engine import LLMEngine


class UnsharedBlockManager(BlockManager):
    """A block manager whose forks end up copying instead of sharing."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._to_unshare: set[int] = set()  # forked sequences that still share blocks

    def fork(self, parent: Sequence, child: Sequence) -> None:
        super().fork(parent, child)
        self._to_unshare.add(child.seq_id)

    def _shared(self, seq: Sequence) -> list[int]:
        table, first = self.tables[seq.seq_id], len(self.tables[seq.seq_id]) - len(self.held_blocks(seq))
        return [i for i in range(first, len(table)) if self.gpu.ref_counts[table[i]] > 1]

    def _append_plan(self, seq: Sequence) -> tuple[list[int], int, list[int]]:
        """A forked sequence's next append copies every block it still shares, not only the one it writes into."""
        table, needed, shared = super()._append_plan(seq)
        if seq.seq_id in self._to_unshare:
            shared = self._shared(seq)
        return table, needed, shared

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]] | None:
        copies = super().append_slots(seq)
        if copies is not None:
            self._to_unshare.discard(seq.seq_id)
        return copies

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """Room for every sequence's own copy of its blocks, plus one to grow each (they unshare on their next step)."""
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        needed = sum(len(self.held_blocks(seq)) for seq in seqs) + len(seqs)
        if needed > self.gpu.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if self.num_available - needed >= self.watermark_blocks else AllocStatus.LATER

    def free(self, seq: Sequence) -> None:
        self._to_unshare.discard(seq.seq_id)
        super().free(seq)


class UnsharedEngine(LLMEngine):
    """:class:`LLMEngine` over an :class:`UnsharedBlockManager` (same pools, same watermark)."""

    def _allocate_cache(self, max_model_len: int, kv_window: int | None) -> BlockManager:
        shared = super()._allocate_cache(max_model_len, kv_window)
        return UnsharedBlockManager(
            shared.block_size,
            shared.gpu.num_blocks,
            shared.cpu.num_blocks,
            shared.enable_prefix_caching,
            sliding_window=kv_window,
        )
