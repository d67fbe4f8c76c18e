"""A pool of physical KV blocks on one device, with reference counts and a prefix cache.

NOTE: a block's reference count is the number of block tables that hold it. A block
whose count drops to zero goes back to the free list, unless it is registered in the
prefix cache: then it is *evictable*, keeps its contents and its hash, and can be
handed to a new request that asks for the same hash. Evictable blocks are reused in
least-recently-freed order only when the free list is empty.

NOTE: a cache hit is never taken on the hash alone. Each registered block records its
:class:`BlockContent` (its tokens and what precedes them) and a lookup must present the
same content, so even a colliding hash cannot hand one prompt's KV to another. A block's
*generation* counts its allocations: a child that names its parent as (block,
generation) stops matching once that parent block is reused for other tokens.

    free list:   [7, 9, 2]           never cached, contents meaningless
    evictable:   {4: h(..), 1: h(..)} oldest first, contents valid, ref 0
    in use:      ref >= 1

A pool given an ``events`` list records there what leaves the cache (:class:`BlockRemoved`
on eviction, :class:`AllBlocksCleared` on a reset); what enters it is recorded by the
prefix cache (:mod:`pagedllm.server.core.prefix_cache`), which knows the blocks' tokens.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from pagedllm.server.core.kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent, external_hash

BlockHash = bytes
"""A full block's prefix-cache key (see :func:`pagedllm.server.core.prefix_cache.block_hash`)."""
BlockIdent = tuple[int, int]
"""(block, generation): one use of a physical block, distinct from its later reuses."""


@dataclass(frozen=True)
class BlockContent:
    """What a full cached block holds, compared on every hit."""

    parent: BlockIdent | bytes
    """The block before it, or for a sequence's first block the digest of its cache salt."""
    token_ids: tuple[int, ...]


class BlockPool:
    """Physical blocks ``0 .. num_blocks-1`` of one device."""

    def __init__(self, num_blocks: int, enable_caching: bool = False, events: list[KVCacheEvent] | None = None) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events
        """Where cache removals are recorded, in order; None: not recorded."""
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[BlockHash, int] = {}
        self._block_to_hash: dict[int, BlockHash] = {}
        self._content: dict[int, BlockContent] = {}
        self._generation = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks that an allocation may take: free plus evictable."""
        return len(self._free) + len(self._evictable)

    def allocate(self) -> int:
        """Take a block with reference count 1; evicts the oldest cached block if needed."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            evicted = self._block_to_hash.pop(block)
            del self._hash_to_block[evicted]
            del self._content[block]
            if self.events is not None:
                self.events.append(BlockRemoved((external_hash(evicted),)))
        else:
            raise RuntimeError("no free KV block: callers must check capacity first")
        self.ref_counts[block] = 1
        self._generation[block] += 1
        return block

    def ident(self, block: int) -> BlockIdent:
        return block, self._generation[block]

    def incref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} is not in use"
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} freed twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self._block_to_hash:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # -- prefix cache -------------------------------------------------------------------
    def cached_block(self, block_hash: BlockHash, content: BlockContent) -> int | None:
        """The registered block for ``block_hash`` if it holds exactly ``content``, without taking it."""
        block = self._hash_to_block.get(block_hash)
        if block is None or self._content[block] != content:
            return None
        return block

    def take_cached(self, block: int) -> None:
        """Take a reference to a block :meth:`cached_block` returned (reviving it if evictable)."""
        assert block in self._block_to_hash, f"block {block} is not cached"
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def has_hash(self, block_hash: BlockHash) -> bool:
        """Whether some block is cached under ``block_hash``."""
        return block_hash in self._hash_to_block

    def register(self, block: int, block_hash: BlockHash, content: BlockContent) -> bool:
        """Record that ``block`` (full, computed) holds ``content``, hashed by ``block_hash``.

        True if that entered the cache; False when caching is off, the block is cached
        already, or another block holds the hash (then this one stays uncached).
        """
        if not self.enable_caching or block_hash in self._hash_to_block or block in self._block_to_hash:
            return False
        self._hash_to_block[block_hash] = block
        self._block_to_hash[block] = block_hash
        self._content[block] = content
        return True

    def reset_cache(self) -> bool:
        """Forget every cached block, making the evictable ones free; refused (False) while any block is held.

        NOTE: as in vLLM, only an idle pool is reset: a block a sequence holds would
        otherwise be cached again as soon as the sequence fills its next block.
        """
        if any(self.ref_counts):
            return False
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_to_block.clear()
        self._block_to_hash.clear()
        self._content.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def check_invariants(self, held: list[int]) -> list[str]:
        """Problems with the pool given ``held[b]``, the number of block tables holding block b."""
        name = f"pool of {self.num_blocks}"
        problems = [
            f"{name}: block {b} has {c} references but {h} tables hold it"
            for b, (c, h) in enumerate(zip(self.ref_counts, held))
            if c != h
        ]
        idle = list(self._free) + list(self._evictable)
        if len(set(idle)) != len(idle):
            problems.append(f"{name}: a block is listed twice among free and evictable blocks")
        busy = [b for b in idle if self.ref_counts[b] != 0]
        if busy:
            problems.append(f"{name}: blocks {busy[:5]} are free yet referenced")
        if len(idle) + sum(1 for c in self.ref_counts if c > 0) != self.num_blocks:
            problems.append(f"{name}: free, evictable and in-use blocks do not add up to {self.num_blocks}")
        return problems

    @property
    def num_cached(self) -> int:
        return len(self._hash_to_block)
