"""Automatic prefix caching: full blocks keyed by the hash of (parent key, token ids).

A sequence's full, computed blocks are hashed in a chain, each key covering the whole
prefix up to its block, and registered in the device pool; a new prompt finds the
longest run of its full blocks already cached and skips computing them::

    salt ──► h0 = H(salt, t0..t3) ──► h1 = H(h0, t4..t7) ──► h2 = H(h1, t8..t11)
              block 7                  block 3                  block 12

The pool keeps freed cached blocks evictable until their memory is needed (see
:mod:`pagedllm.server.core.block_pool`); what enters the cache is recorded here as KV
events, what leaves it by the pool.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence as Seq

from pagedllm.server.core.block_pool import BlockContent, BlockHash, BlockIdent, BlockPool
from pagedllm.server.core.block_tables import BlockTables
from pagedllm.server.core.kv_events import KVCacheEvent, blocks_stored
from pagedllm.server.core.sequence import Sequence


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


class PrefixCache:
    """The chain hashes of each sequence's full, computed blocks, and their lookups in the device pool.

    NOTE: it never changes which sequence holds which block: it finds cached blocks for the
    block manager to take, and registers the blocks the block manager's tables hold.
    """

    def __init__(self, block_size: int, pool: BlockPool, enabled: bool, events: list[KVCacheEvent] | None) -> None:
        self.block_size = block_size
        self.pool = pool
        self.enabled = enabled
        self.events = events
        """What entered and left the device prefix cache since :meth:`take_events`; None: not recorded."""
        self.hashes: dict[int, list[BlockHash]] = {}
        """seq_id -> chain hashes of the sequence's full, computed blocks."""

    def chain_hashes(self, seq: Sequence, num_blocks: int, start: list[BlockHash]) -> list[BlockHash]:
        hashes = list(start)
        bs, tokens = self.block_size, seq.token_ids
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else salt_digest(seq.cache_salt, seq.lora_int_id)
            hashes.append(block_hash(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def content(self, seq: Sequence, index: int, parent: BlockIdent | None) -> BlockContent:
        bs = self.block_size
        tokens = tuple(seq.token_ids[index * bs : (index + 1) * bs])
        return BlockContent(parent if parent is not None else salt_digest(seq.cache_salt, seq.lora_int_id), tokens)

    def lookup(self, seq: Sequence) -> tuple[list[BlockHash], list[int]]:
        """The longest run of the prompt's full blocks found in the cache: their hashes and blocks.

        NOTE: at least one token is always left to compute, so the step yields logits.
        """
        if not self.enabled:
            return [], []
        hashes = self.chain_hashes(seq, (len(seq) - 1) // self.block_size, [])
        blocks: list[int] = []
        for i, key in enumerate(hashes):
            parent = self.pool.ident(blocks[-1]) if blocks else None
            block = self.pool.cached_block(key, self.content(seq, i, parent))
            if block is None:
                break
            blocks.append(block)
        return hashes[: len(blocks)], blocks

    def cache_full_blocks(self, seq: Sequence, tables: BlockTables) -> None:
        """Hash and register the sequence's full blocks computed since the last call."""
        hashes = self.hashes[seq.seq_id]
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= len(hashes):
            return
        hashes[:] = self.chain_hashes(seq, num_full, hashes)
        self.register(seq, tables.tables[seq.seq_id], tables.first_held(seq.seq_id))

    def register(self, seq: Sequence, table: list[int], first_held: int) -> None:
        """Register the sequence's hashed blocks from ``first_held`` on (``table`` holds them on the device)."""
        # NOTE: freed entries are stale (another sequence may hold those blocks now), and the
        # first held block's predecessor is one of them: caching starts after it. A block whose
        # predecessor's hash is not cached could never be reached by a prefix lookup (and a KV
        # event would name a parent no subscriber knows): caching stops there.
        hashes = self.hashes[seq.seq_id]
        stored = []
        for i in range(first_held + 1 if first_held else 0, len(hashes)):
            if i and not self.pool.has_hash(hashes[i - 1]):
                break
            parent = self.pool.ident(table[i - 1]) if i else None
            if self.pool.register(table[i], hashes[i], self.content(seq, i, parent)):
                stored.append(i)
        if stored and self.events is not None:
            self.events.extend(blocks_stored(hashes, seq.token_ids, self.block_size, stored))

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix-cache events recorded since the last call, oldest first (none when not recording)."""
        if not self.events:
            return []
        events = list(self.events)
        self.events.clear()  # NOTE: in place: the device pool records into the same list
        return events
