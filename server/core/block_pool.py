"""A pool of physical KV blocks on one device, with reference counts and a prefix cache.

NOTE: a block's reference count is the number of block tables that hold it. A block
whose count drops to zero goes back to the free list, unless it is registered in the
prefix cache: then it is *evictable*, keeps its contents and its hash, and can be
handed to a new request that asks for the same hash. Evictable blocks are reused in
least-recently-freed order only when the free list is empty.

    free list:   [7, 9, 2]           never cached, contents meaningless
    evictable:   {4: h(..), 1: h(..)} oldest first, contents valid, ref 0
    in use:      ref >= 1
"""

from __future__ import annotations

from collections import OrderedDict, deque

BlockHash = bytes
"""A full block's prefix-cache key (see :func:`pagedllm.server.core.block_manager.block_hash`)."""


class BlockPool:
    """Physical blocks ``0 .. num_blocks-1`` of one device."""

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[BlockHash, int] = {}
        self._block_to_hash: dict[int, BlockHash] = {}

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
            del self._hash_to_block[self._block_to_hash.pop(block)]
        else:
            raise RuntimeError("no free KV block: callers must check capacity first")
        self.ref_counts[block] = 1
        return block

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
    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The registered block holding ``block_hash``, without taking it."""
        return self._hash_to_block.get(block_hash)

    def take_cached(self, block_hash: BlockHash) -> int | None:
        """Take a reference to the cached block for ``block_hash``, if there is one."""
        block = self._hash_to_block.get(block_hash)
        if block is None:
            return None
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1
        return block

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Record that ``block`` (full, computed) holds the tokens hashed by ``block_hash``."""
        if not self.enable_caching or block_hash in self._hash_to_block or block in self._block_to_hash:
            return
        self._hash_to_block[block_hash] = block
        self._block_to_hash[block] = block_hash

    @property
    def num_cached(self) -> int:
        return len(self._hash_to_block)
