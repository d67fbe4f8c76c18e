"""Block manager: allocates, shares, copies on write, swaps and frees KV blocks for sequences.

Each sequence's blocks are named by its block table (:mod:`pagedllm.server.core.block_tables`).
Sequences forked from one another share blocks (reference counts > 1). Writing the
next token into a shared last block first copies it (copy-on-write); the copy is
reported as a (src, dst) pair for the worker to perform before the step runs. Full
blocks are found again by prefix caching (:mod:`pagedllm.server.core.prefix_cache`).

When every layer of the model attends within a sliding window of W positions, a query
at position q reads nothing before q - W + 1, and later queries read even less. A block
whose last position lies before the window of the sequence's next query is dead for
good, and its reference is dropped (it goes back to the pool, or to the evictable list
if cached)::

    W = 6, B = 4, next query at position 13: it sees 8..13
    table:   [ 7 , 3 , 12 , 5 ]     logical blocks 0 and 1 (positions 0..7) are dead
              ^^^^^^^               freed; the entries stay, stale, so that position p
                                    still maps to table[p // B]: attention never reads them
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedllm.server.core.block_pool import BlockHash, BlockPool
from pagedllm.server.core.block_tables import BlockTables
from pagedllm.server.core.kv_events import KVCacheEvent
from pagedllm.server.core.kv_reservation import KVReservation
from pagedllm.server.core.prefix_cache import PrefixCache, block_hash, salt_digest
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["AllocStatus", "BlockManager", "SharingStats", "block_hash", "salt_digest"]


class AllocStatus(enum.Enum):
    OK = "ok"
    LATER = "later"
    NEVER = "never"


@dataclass
class SharingStats:
    """Blocks in use against what the same sequences would use without sharing."""

    used: int
    unshared: int

    @property
    def saving(self) -> float:
        return 1.0 - self.used / self.unshared if self.unshared else 0.0


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Allocates, shares, copies on write, swaps and frees KV blocks for sequences."""

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        enable_prefix_caching: bool = False,
        watermark: float = 0.01,
        reservation: KVReservation | None = None,
        sliding_window: int | None = None,
        kv_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        """The window every layer attends within (None: some layer sees the whole context); blocks
        before the window of a sequence's next query are freed (not under a reservation)."""
        self.reservation = reservation
        """None: paging (blocks on demand); else a benchmark's reservation-based baseline."""
        events: list[KVCacheEvent] | None = [] if kv_events else None
        self.gpu = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching, events=events)
        self.cpu = BlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.block_tables = BlockTables()
        self.prefix_cache = PrefixCache(block_size, self.gpu, enable_prefix_caching, events)
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found cached
        self.num_copy_on_writes = 0
        self.num_window_frees = 0  # blocks released because they fell out of every layer's window

    @property
    def tables(self) -> dict[int, list[int]]:
        """seq_id -> its block table (see :class:`BlockTables`)."""
        return self.block_tables.tables

    @property
    def table_versions(self) -> dict[int, int]:
        """seq_id -> the stamp of its table (see :attr:`BlockTables.versions`)."""
        return self.block_tables.versions

    @property
    def kv_events(self) -> list[KVCacheEvent] | None:
        """What entered and left the device prefix cache since :meth:`take_kv_events`; None: not recorded."""
        return self.prefix_cache.events

    @kv_events.setter
    def kv_events(self, events: list[KVCacheEvent] | None) -> None:
        self.prefix_cache.events = events

    @property
    def _hashes(self) -> dict[int, list[BlockHash]]:
        return self.prefix_cache.hashes

    # -- allocation ---------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Device blocks free for anyone: free and evictable blocks less those promised by reservations."""
        return self.gpu.num_free - (self.reservation.outstanding if self.reservation else 0)

    def reserved_blocks(self, seq: Sequence) -> int:
        """Blocks promised to the sequence by its reservation and not yet allocated (0 when paging)."""
        return self.reservation.left(seq.seq_id) if self.reservation else 0

    def _blocks_at_admission(self, seq: Sequence) -> int:
        needed = _blocks_for(len(seq), self.block_size)
        return max(needed, self.reservation.blocks(seq.seq_id)) if self.reservation else needed

    def can_allocate(self, group: SequenceGroup, use_cache: bool = True) -> AllocStatus:
        needed = 0
        for seq in group.get_seqs(SequenceStatus.WAITING):
            needed += self._blocks_at_admission(seq)
            if use_cache:
                _, cached = self.prefix_cache.lookup(seq)
                needed -= sum(1 for block in cached if self.gpu.ref_counts[block] > 0)
        if needed > self.gpu.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.num_available - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq: Sequence, use_cache: bool = True) -> int:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks; return
        how many of its tokens those cached blocks hold (the caller counts them as computed)."""
        assert seq.seq_id not in self.block_tables, f"sequence {seq.seq_id} already has blocks"
        hashes, table = self.prefix_cache.lookup(seq) if use_cache else ([], [])
        for block in table:
            self.gpu.take_cached(block)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(seq)
            self.prefix_cache_hits += len(table) * self.block_size
        for _ in range(len(table), _blocks_for(len(seq), self.block_size)):
            table.append(self.gpu.allocate())
        self.block_tables.add(seq.seq_id, table)
        self.prefix_cache.hashes[seq.seq_id] = hashes
        if self.reservation:
            self.reservation.hold(seq.seq_id, len(table))
        num_cached = len(hashes) * self.block_size
        self._free_out_of_window(seq, num_cached)  # a long cached prefix may reach past the window
        return num_cached

    def can_append_slots(self, seqs: list[Sequence]) -> bool:
        """Whether every one of ``seqs`` (a group's running sequences) can get slots for its uncomputed tokens."""
        return self.blocks_to_append(seqs) <= self.num_available

    def blocks_to_append(self, seqs: list[Sequence]) -> int:
        """New blocks (fresh or copy-on-write) ``seqs`` need for their uncomputed tokens, beyond their reservations."""
        return sum(self._new_blocks(seq, *self._append_plan(seq)) for seq in seqs)

    def _append_plan(self, seq: Sequence) -> tuple[list[int], int, list[int]]:
        """The sequence's table, how many blocks its tokens and proposals need, and the indices of
        the shared blocks its uncomputed tokens write into (each needs a copy first).

        NOTE: only the block the next tokens are written into can be shared and unfull; full
        blocks before it are never written again. A decode looks at one block.
        """
        table = self.block_tables.tables[seq.seq_id]
        needed = _blocks_for(seq.num_slot_tokens, self.block_size)
        ref_counts = self.gpu.ref_counts
        first = seq.num_computed_tokens // self.block_size
        if first == needed - 1 < len(table):  # a decode's one block
            return table, needed, [first] if ref_counts[table[first]] > 1 else []
        shared = [i for i in range(first, min(needed, len(table))) if ref_counts[table[i]] > 1]
        return table, needed, shared

    def _new_blocks(self, seq: Sequence, table: list[int], needed: int, shared: list[int]) -> int:
        new = max(0, needed - len(table)) + len(shared)
        return max(0, new - self.reserved_blocks(seq)) if self.reservation else new

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Make room for every token of ``seq`` and its proposals: the copy-on-write (src, dst)
        pairs, or None when the cache has no room (then nothing changed)."""
        table, needed, shared = plan = self._append_plan(seq)
        if not (needed > len(table) or shared):
            return []  # NOTE: the usual decode: its token lands in a block it holds alone
        if self._new_blocks(seq, *plan) > self.num_available:
            return None
        while len(table) < needed:
            table.append(self._allocate_for(seq))
        copies = []
        for i in shared:
            new = self._allocate_for(seq)
            self.gpu.decref(table[i])
            copies.append((table[i], new))
            table[i] = new
        if copies:
            self.block_tables.rewritten(seq.seq_id)
            self.num_copy_on_writes += len(copies)
        return copies

    def release_unused_slots(self, seq: Sequence) -> None:
        """Free the table's blocks past the sequence's tokens: those that held only rejected proposals.

        NOTE: slots of rejected proposals inside kept blocks hold stale K/V past the computed
        tokens; attention never reads past a context and the next step overwrites them. Such
        blocks are never cached: only blocks full of computed (accepted) tokens are hashed.
        """
        table = self.tables[seq.seq_id]
        keep = max(_blocks_for(seq.num_slot_tokens, self.block_size), self.block_tables.first_held(seq.seq_id))
        if len(table) <= keep:
            return
        assert self.reservation is None, "speculative decoding runs on paging only"
        for block in reversed(table[keep:]):
            self.gpu.decref(block)
        del table[keep:]
        self.block_tables.rewritten(seq.seq_id)

    def _allocate_for(self, seq: Sequence) -> int:
        if self.reservation:
            self.reservation.draw(seq.seq_id)
        return self.gpu.allocate()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block the parent holds (its freed entries stay freed)."""
        pool = self._pool_of(parent)
        for block in self.held_blocks(parent):
            pool.incref(block)
        self.block_tables.fork(parent.seq_id, child.seq_id)
        self.prefix_cache.hashes[child.seq_id] = list(self.prefix_cache.hashes[parent.seq_id])

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; a no-op for a sequence without blocks."""
        pool = self._pool_of(seq)
        held = self.block_tables.remove(seq.seq_id)
        self.prefix_cache.hashes.pop(seq.seq_id, None)
        if self.reservation:
            self.reservation.release(seq.seq_id, finished=seq.status.finished)
        if held is None:
            return
        self.block_tables.on_host.discard(seq.seq_id)
        for block in reversed(held):  # NOTE: tail blocks become least recently used
            pool.decref(block)

    def held_blocks(self, seq: Sequence) -> list[int]:
        """The blocks the sequence holds: its table less the entries freed as out of the window."""
        return self.block_tables.held(seq.seq_id)

    def _free_out_of_window(self, seq: Sequence, num_computed: int) -> None:
        """Drop the blocks no query of ``seq`` will read again: those whose every position lies
        before the window of its next query (position ``num_computed``).

        NOTE: a block is cached naming the block before it, so with prefix caching the block
        before the next one to cache is kept until that one is cached (with windows of at
        most a block, one block more than the window needs).
        """
        if self.sliding_window is None or self.reservation:
            return
        dead = max(0, num_computed - self.sliding_window + 1) // self.block_size
        if self.enable_prefix_caching:
            dead = min(dead, len(self.prefix_cache.hashes[seq.seq_id]) - 1)
        freed = self.block_tables.first_held(seq.seq_id)
        if dead <= freed:
            return
        assert seq.seq_id not in self.block_tables.on_host, "only a running sequence advances"
        for block in self.tables[seq.seq_id][freed:dead]:
            self.gpu.decref(block)
        self.block_tables.num_freed[seq.seq_id] = dead
        self.num_window_frees += dead - freed

    def _pool_of(self, seq: Sequence) -> BlockPool:
        return self.cpu if seq.seq_id in self.block_tables.on_host else self.gpu

    def mark_computed(self, seq: Sequence) -> None:
        """After a step: register the sequence's newly completed full blocks in the prefix
        cache, and free the blocks that fell out of the window."""
        if seq.seq_id not in self.block_tables.tables:
            return
        if self.enable_prefix_caching:
            self.prefix_cache.cache_full_blocks(seq, self.block_tables)
        self._free_out_of_window(seq, seq.num_computed_tokens)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix-cache events recorded since the last call, oldest first (none when not recording)."""
        return self.prefix_cache.take_events()

    def reset_prefix_cache(self) -> bool:
        """Empty the device prefix cache (recording :class:`AllBlocksCleared`); False while any block is held."""
        return self.gpu.reset_cache()

    # -- swapping -----------------------------------------------------------------------
    def _unique_blocks(self, group: SequenceGroup, status: SequenceStatus) -> list[int]:
        seen: dict[int, None] = {}
        for seq in group.get_seqs(status):
            for block in self.held_blocks(seq):
                seen[block] = None
        return list(seen)

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return len(self._unique_blocks(group, SequenceStatus.RUNNING)) <= self.cpu.num_free

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        needed = len(self._unique_blocks(group, SequenceStatus.SWAPPED)) + len(seqs)
        if needed > self.gpu.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if self.gpu.num_free - needed >= self.watermark_blocks else AllocStatus.LATER

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's running sequences to host blocks: (device, host) pairs."""
        seq_ids = [seq.seq_id for seq in group.get_seqs(SequenceStatus.RUNNING)]
        return self.block_tables.move(seq_ids, self.gpu, self.cpu, to_host=True)

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's swapped sequences back to device blocks: (host, device) pairs."""
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        mapping = self.block_tables.move([seq.seq_id for seq in seqs], self.cpu, self.gpu, to_host=False)
        for seq in seqs:
            self.prefix_cache.register(seq, self.tables[seq.seq_id], self.block_tables.first_held(seq.seq_id))
        return mapping

    # -- inspection ---------------------------------------------------------------------
    def check_invariants(self) -> list[str]:
        """What is wrong with the bookkeeping, if anything: every reference count must equal
        the number of tables holding the block, and every block must be free, evictable or
        in use, exactly one of them."""
        problems = []
        for pool, host in ((self.gpu, False), (self.cpu, True)):
            problems += pool.check_invariants(self.block_tables.held_counts(pool.num_blocks, host))
        return problems

    def block_table(self, seq: Sequence) -> list[int]:
        """The sequence's whole table, position p in entry p // block_size (freed entries included)."""
        return self.tables[seq.seq_id]

    def sharing_stats(self) -> SharingStats:
        device_tables = self.block_tables.device_held()
        used = len({b for t in device_tables for b in t})
        unshared = sum(len(t) for t in device_tables)
        return SharingStats(used=used, unshared=unshared)
