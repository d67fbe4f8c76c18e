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

    def _blocks_to_append(self, seq: Sequence) -> int:
        if seq.seq_id not in self._to_unshare:
            return super()._blocks_to_append(seq)
        growth = max(0, -(-seq.num_tokens // self.block_size) - len(self.tables[seq.seq_id]))
        return len(self._shared(seq)) + growth

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        copies = []
        if seq.seq_id in self._to_unshare:
            self._to_unshare.discard(seq.seq_id)
            table = self.tables[seq.seq_id]
            for i in self._shared(seq):
                new = self._allocate_for(seq)
                self.gpu.decref(table[i])
                copies.append((table[i], new))
                table[i] = new
            if copies:
                self._rewritten(seq.seq_id)  # NOTE: the worker's mirror of the table must be rebuilt
            self.num_copy_on_writes += len(copies)
        return copies + super().append_slots(seq)

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
