"""Block tables: which physical KV blocks hold each sequence's tokens.

Logical block ``i`` of a sequence holds token positions ``[i*B, (i+1)*B)``; its table
maps it to a physical block of the device pool (or the host pool while swapped out)::

    seq tokens:   t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9        (block_size B = 4)
    logical:          0       |     1       |   2
    table:        [    7      ,     3       ,   12  ]      slot of t9 = 12*4 + 1

Sequences forked from one another share blocks (reference counts > 1). Writing the
next token into a shared last block first copies it (copy-on-write); the copy is
reported as a (src, dst) pair for the worker to perform before the step runs.

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
import hashlib
import struct
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pagedllm.server.core.block_pool import BlockContent, BlockHash, BlockIdent, BlockPool
from pagedllm.server.core.kv_events import KVCacheEvent, blocks_stored
from pagedllm.server.core.kv_reservation import KVReservation
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus


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


def block_hash(parent: BlockHash | None, token_ids: Seq[int]) -> BlockHash:
    """The prefix-cache key of a full block: sha256 over its parent's key and its tokens.

    NOTE: the key only finds a candidate block. The hit itself compares the block's tokens
    and its parent (its :class:`BlockContent`, in :meth:`BlockPool.cached_block`), so even
    a colliding key cannot hand one request's KV blocks to another; a collision costs a
    cache miss. Chained through the parent, equal keys stand for equal whole prefixes, and
    a 256-bit digest keeps such misses out of the way.
    """
    digest = hashlib.sha256(parent or b"")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def salt_digest(cache_salt: str | None, lora_int_id: int = 0) -> bytes:
    """What a sequence's first block hangs from: nothing, or the digest of its cache salt and LoRA adapter.

    NOTE: the adapter id is part of every block's key (through the chain), so two adapters,
    or an adapter and the base model, never share KV blocks: their K/V differ for equal tokens.
    """
    if cache_salt is None and not lora_int_id:
        return b""
    digest = hashlib.sha256(b"cache_salt:" + cache_salt.encode()) if cache_salt is not None else hashlib.sha256()
    if lora_int_id:
        digest.update(b"lora:%d" % lora_int_id)
    return digest.digest()


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
        self.kv_events: list[KVCacheEvent] | None = [] if kv_events else None
        """What entered and left the device prefix cache since :meth:`take_kv_events`; None: not recorded."""
        self.gpu = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching, events=self.kv_events)
        self.cpu = BlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.tables: dict[int, list[int]] = {}
        self.table_versions: dict[int, int] = {}
        """seq_id -> a stamp that changes whenever the sequence's table changes other than by appending.

        NOTE: a worker that mirrors block tables across steps may keep its copy of a table
        while the stamp is unchanged and write only the entries past its copy's length:
        between two equal stamps the table only grew at its end. Stamps come from one
        counter and are never reused, so a sequence freed and allocated again (recompute
        preemption) or a table rebuilt in place (copy-on-write, swap) always gets a new one.
        """
        self._version_counter = 0
        self._on_host: set[int] = set()  # sequences whose table holds host blocks
        self._num_freed: dict[int, int] = {}
        """seq_id -> leading table entries freed as out of the window (absent: none).

        NOTE: those entries are stale ids the sequence no longer holds; everything that
        walks a table for the blocks it holds (free, fork, swap, caching, accounting)
        starts past them. Attention does not read them: it starts at the window.
        """
        # Chain hashes of the sequence's full, computed blocks (prefix caching).
        self._hashes: dict[int, list[BlockHash]] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found cached
        self.num_copy_on_writes = 0
        self.num_window_frees = 0  # blocks released because they fell out of every layer's window

    # -- hashing ------------------------------------------------------------------------
    def _chain_hashes(self, seq: Sequence, num_blocks: int, start: list[BlockHash]) -> list[BlockHash]:
        hashes = list(start)
        bs, tokens = self.block_size, seq.token_ids
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else salt_digest(seq.cache_salt, seq.lora_int_id)
            hashes.append(block_hash(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def _content(self, seq: Sequence, index: int, parent: BlockIdent | None) -> BlockContent:
        bs = self.block_size
        tokens = tuple(seq.token_ids[index * bs : (index + 1) * bs])
        return BlockContent(parent if parent is not None else salt_digest(seq.cache_salt, seq.lora_int_id), tokens)

    def _cached_prefix(self, seq: Sequence) -> tuple[list[BlockHash], list[int]]:
        """The longest run of the prompt's full blocks found in the cache: their hashes and blocks.

        NOTE: at least one token is always left to compute, so the step yields logits.
        """
        if not self.enable_prefix_caching:
            return [], []
        hashes = self._chain_hashes(seq, (len(seq) - 1) // self.block_size, [])
        blocks: list[int] = []
        for i, key in enumerate(hashes):
            parent = self.gpu.ident(blocks[-1]) if blocks else None
            block = self.gpu.cached_block(key, self._content(seq, i, parent))
            if block is None:
                break
            blocks.append(block)
        return hashes[: len(blocks)], blocks

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
                _, cached = self._cached_prefix(seq)
                needed -= sum(1 for block in cached if self.gpu.ref_counts[block] > 0)
        if needed > self.gpu.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.num_available - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq: Sequence, use_cache: bool = True) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        assert seq.seq_id not in self.tables, f"sequence {seq.seq_id} already has blocks"
        hashes, table = self._cached_prefix(seq) if use_cache else ([], [])
        for block in table:
            self.gpu.take_cached(block)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(seq)
            self.prefix_cache_hits += len(table) * self.block_size
        for _ in range(len(table), _blocks_for(len(seq), self.block_size)):
            table.append(self.gpu.allocate())
        self.tables[seq.seq_id] = table
        self._rewritten(seq.seq_id)
        self._hashes[seq.seq_id] = hashes
        if self.reservation:
            self.reservation.hold(seq.seq_id, len(table))
        seq.num_computed_tokens = len(hashes) * self.block_size
        self._free_out_of_window(seq)  # a long cached prefix may reach past the window

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
        table = self.tables[seq.seq_id]
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
            self._rewritten(seq.seq_id)
            self.num_copy_on_writes += len(copies)
        return copies

    def release_unused_slots(self, seq: Sequence) -> None:
        """Free the table's blocks past the sequence's tokens: those that held only rejected proposals.

        NOTE: slots of rejected proposals inside kept blocks hold stale K/V past the computed
        tokens; attention never reads past a context and the next step overwrites them. Such
        blocks are never cached: only blocks full of computed (accepted) tokens are hashed.
        """
        table = self.tables[seq.seq_id]
        keep = max(_blocks_for(seq.num_slot_tokens, self.block_size), self._num_freed.get(seq.seq_id, 0))
        if len(table) <= keep:
            return
        assert self.reservation is None, "speculative decoding runs on paging only"
        for block in reversed(table[keep:]):
            self.gpu.decref(block)
        del table[keep:]
        self._rewritten(seq.seq_id)

    def _rewritten(self, seq_id: int) -> None:
        """Record that the table of ``seq_id`` changed other than by appending (see ``table_versions``)."""
        self._version_counter += 1
        self.table_versions[seq_id] = self._version_counter

    def _allocate_for(self, seq: Sequence) -> int:
        if self.reservation:
            self.reservation.draw(seq.seq_id)
        return self.gpu.allocate()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block the parent holds (its freed entries stay freed)."""
        table = list(self.tables[parent.seq_id])
        pool = self._pool_of(parent)
        for block in self.held_blocks(parent):
            pool.incref(block)
        self.tables[child.seq_id] = table
        self._rewritten(child.seq_id)
        self._hashes[child.seq_id] = list(self._hashes[parent.seq_id])
        if parent.seq_id in self._num_freed:
            self._num_freed[child.seq_id] = self._num_freed[parent.seq_id]

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; a no-op for a sequence without blocks."""
        held = self.held_blocks(seq) if seq.seq_id in self.tables else None
        self.tables.pop(seq.seq_id, None)
        self.table_versions.pop(seq.seq_id, None)
        self._hashes.pop(seq.seq_id, None)
        self._num_freed.pop(seq.seq_id, None)
        if self.reservation:
            self.reservation.release(seq.seq_id, finished=seq.status.finished)
        if held is None:
            return
        pool = self._pool_of(seq)
        self._on_host.discard(seq.seq_id)
        for block in reversed(held):  # NOTE: tail blocks become least recently used
            pool.decref(block)

    def held_blocks(self, seq: Sequence) -> list[int]:
        """The blocks the sequence holds: its table less the entries freed as out of the window."""
        return self.tables[seq.seq_id][self._num_freed.get(seq.seq_id, 0) :]

    def _free_out_of_window(self, seq: Sequence) -> None:
        """Drop the blocks no query of ``seq`` will read again: those whose every position lies
        before the window of its next query (position ``seq.num_computed_tokens``).

        NOTE: a block is cached naming the block before it, so with prefix caching the block
        before the next one to cache is kept until that one is cached (with windows of at
        most a block, one block more than the window needs).
        """
        if self.sliding_window is None or self.reservation:
            return
        dead = max(0, seq.num_computed_tokens - self.sliding_window + 1) // self.block_size
        if self.enable_prefix_caching:
            dead = min(dead, len(self._hashes[seq.seq_id]) - 1)
        freed = self._num_freed.get(seq.seq_id, 0)
        if dead <= freed:
            return
        assert seq.seq_id not in self._on_host, "only a running sequence advances"
        for block in self.tables[seq.seq_id][freed:dead]:
            self.gpu.decref(block)
        self._num_freed[seq.seq_id] = dead
        self.num_window_frees += dead - freed

    def _pool_of(self, seq: Sequence) -> BlockPool:
        return self.cpu if seq.seq_id in self._on_host else self.gpu

    def mark_computed(self, seq: Sequence) -> None:
        """After a step: register the sequence's newly completed full blocks in the prefix
        cache, and free the blocks that fell out of the window."""
        if seq.seq_id not in self.tables:
            return
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq)
        self._free_out_of_window(seq)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        hashes = self._hashes[seq.seq_id]
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= len(hashes):
            return
        hashes[:] = self._chain_hashes(seq, num_full, hashes)
        self._register(seq, self.tables[seq.seq_id], hashes)

    def _register(self, seq: Sequence, table: list[int], hashes: list[BlockHash]) -> None:
        # NOTE: freed entries are stale (another sequence may hold those blocks now), and the
        # first held block's predecessor is one of them: caching starts after it. A block whose
        # predecessor's hash is not cached could never be reached by a prefix lookup (and a KV
        # event would name a parent no subscriber knows): caching stops there.
        freed = self._num_freed.get(seq.seq_id, 0)
        stored = []
        for i in range(freed + 1 if freed else 0, len(hashes)):
            if i and not self.gpu.has_hash(hashes[i - 1]):
                break
            parent = self.gpu.ident(table[i - 1]) if i else None
            if self.gpu.register(table[i], hashes[i], self._content(seq, i, parent)):
                stored.append(i)
        if stored and self.kv_events is not None:
            self.kv_events.extend(blocks_stored(hashes, seq.token_ids, self.block_size, stored))

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix-cache events recorded since the last call, oldest first (none when not recording)."""
        if not self.kv_events:
            return []
        events = list(self.kv_events)
        self.kv_events.clear()  # NOTE: in place: the device pool records into the same list
        return events

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
        return self._move(group, SequenceStatus.RUNNING, self.gpu, self.cpu)

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's swapped sequences back to device blocks: (host, device) pairs."""
        mapping = self._move(group, SequenceStatus.SWAPPED, self.cpu, self.gpu)
        for seq in group.get_seqs(SequenceStatus.SWAPPED):
            self._register(seq, self.tables[seq.seq_id], self._hashes[seq.seq_id])
        return mapping

    def _move(
        self, group: SequenceGroup, status: SequenceStatus, src: BlockPool, dst: BlockPool
    ) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}
        for seq in group.get_seqs(status):
            table = self.tables[seq.seq_id]
            for i in range(self._num_freed.get(seq.seq_id, 0), len(table)):  # held blocks only
                block = table[i]
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                src.decref(block)
                table[i] = mapping[block]
            self._rewritten(seq.seq_id)
            if dst is self.cpu:
                self._on_host.add(seq.seq_id)
            else:
                self._on_host.discard(seq.seq_id)
        return list(mapping.items())

    # -- inspection ---------------------------------------------------------------------
    def check_invariants(self) -> list[str]:
        """What is wrong with the bookkeeping, if anything: every reference count must equal
        the number of tables holding the block, and every block must be free, evictable or
        in use, exactly one of them."""
        problems = []
        for pool, host in ((self.gpu, False), (self.cpu, True)):
            held = [0] * pool.num_blocks
            for seq_id, table in self.tables.items():
                if (seq_id in self._on_host) == host:
                    for block in table[self._num_freed.get(seq_id, 0) :]:
                        held[block] += 1
            problems += pool.check_invariants(held)
        return problems

    def block_table(self, seq: Sequence) -> list[int]:
        """The sequence's whole table, position p in entry p // block_size (freed entries included)."""
        return self.tables[seq.seq_id]

    def sharing_stats(self) -> SharingStats:
        device_tables = [
            t[self._num_freed.get(seq_id, 0) :] for seq_id, t in self.tables.items() if seq_id not in self._on_host
        ]
        used = len({b for t in device_tables for b in t})
        unshared = sum(len(t) for t in device_tables)
        return SharingStats(used=used, unshared=unshared)
