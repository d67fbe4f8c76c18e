"""What happened to the device prefix cache, as events a router can follow (vLLM's KV events).

A replica that publishes these lets a router score replicas by the prompt prefix blocks
they hold (llm-d's precise prefix-cache scorer). The block manager records them in order,
the engine drains them once per step and hands them to a publisher
(:mod:`pagedllm.server.engine.kv_events`), which puts them on the wire.

    full block registered in the cache        -> BlockStored  (a run of a sequence's blocks)
    cached block evicted, its memory reused   -> BlockRemoved
    prefix cache reset                        -> AllBlocksCleared

NOTE: hashes are ints: the low 64 bits of the block's sha256 prefix-cache key, read
big-endian, which is what vLLM publishes with integer block hashes and what llm-d takes from
either form (the last 8 bytes of a byte hash). A consumer uses them only as names: a stored
block's hash, its parent's, and a removed block's hash refer to one another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def external_hash(block_hash: bytes) -> int:
    """The published form of a prefix-cache key: its last 8 bytes as a big-endian unsigned int."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one sequence entered the prefix cache."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    """The block before the first one, or None when the first is the sequence's first block."""
    token_ids: tuple[int, ...]
    """The tokens of all the blocks, ``block_size`` per block."""
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks left the prefix cache (their memory went to other tokens)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was emptied: forget every block of this replica."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def blocks_stored(
    keys: Sequence[bytes], token_ids: Sequence[int], block_size: int, new: list[int]
) -> list[BlockStored]:
    """The events for a sequence whose blocks ``new`` (ascending indexes) just entered the cache.

    One :class:`BlockStored` per run of consecutive blocks; ``keys`` are the sequence's
    prefix-cache keys, block by block. NOTE: a run's parent is the key of the block before
    it, which is in the cache: that block entered it earlier, or another block with the
    same key did.
    """
    events = []
    for first, end in _runs(new):
        events.append(
            BlockStored(
                block_hashes=tuple(external_hash(key) for key in keys[first:end]),
                parent_block_hash=external_hash(keys[first - 1]) if first else None,
                token_ids=tuple(token_ids[first * block_size : end * block_size]),
                block_size=block_size,
            )
        )
    return events


def _runs(indexes: list[int]) -> list[tuple[int, int]]:
    """``[0, 1, 2, 5, 6]`` -> ``[(0, 3), (5, 7)]``: half-open ranges of consecutive ascending indexes."""
    runs: list[tuple[int, int]] = []
    for i in indexes:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
