"""Prefix-cache events from the block manager: exact hashes, parents, tokens and order."""

from __future__ import annotations

import hashlib
import struct

from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, blocks_stored, external_hash
from pagedllm.server.core.sequence import Sequence

BS = 4


def key(parent: bytes, tokens: list[int]) -> bytes:
    """The prefix-cache key, written out: sha256 over the parent key and the tokens as int64s."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def chain(tokens: list[int]) -> list[int]:
    """The published hashes of every full block of ``tokens`` (a sequence without cache salt)."""
    keys: list[bytes] = []
    for i in range(len(tokens) // BS):
        keys.append(key(keys[-1] if keys else b"", tokens[i * BS : (i + 1) * BS]))
    return [int.from_bytes(k[-8:], "big") for k in keys]


def manager(num_gpu: int = 6, events: bool = True) -> BlockManager:
    return BlockManager(BS, num_gpu, 4, enable_prefix_caching=True, watermark=0.0, kv_events=events)


def run(bm: BlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    """Admit a sequence and mark all its tokens computed, as a finished prefill does."""
    seq = Sequence(seq_id, tokens)
    seq.num_computed_tokens = bm.allocate(seq)
    seq.num_computed_tokens = len(tokens)
    bm.mark_computed(seq)
    return seq


def test_external_hash_is_the_keys_last_8_bytes_big_endian():
    digest = bytes(range(24, 56))
    assert external_hash(digest) == int.from_bytes(bytes(range(48, 56)), "big")
    assert external_hash(b"\xff" * 32) == (1 << 64) - 1


def test_store_evict_and_clear_in_order_with_exact_hashes():
    bm = manager()
    a_tokens = list(range(9))
    b_tokens = list(range(8)) + [90, 91, 92, 93, 94]
    a_hashes, b_hashes = chain(a_tokens), chain(b_tokens)
    assert a_hashes == b_hashes[:2]

    a = run(bm, 0, a_tokens)
    assert bm.take_kv_events() == [BlockStored(tuple(a_hashes), None, tuple(range(8)), BS)]
    assert bm.take_kv_events() == []  # drained

    b = run(bm, 1, b_tokens)  # shares a's two blocks, stores its third under a's second
    assert bm.block_table(b)[:2] == bm.block_table(a)[:2]
    assert bm.take_kv_events() == [BlockStored((b_hashes[2],), a_hashes[1], (90, 91, 92, 93), BS)]

    bm.free(a)
    bm.free(b)  # evictable, oldest first: b's third block, then the shared second and first
    assert bm.take_kv_events() == []  # freeing keeps blocks cached: nothing left the cache

    c_tokens = list(range(200, 216))
    run(bm, 2, c_tokens)  # 4 blocks: the 3 free ones, then the oldest cached block is evicted
    assert bm.take_kv_events() == [
        BlockRemoved((b_hashes[2],)),
        BlockStored(tuple(chain(c_tokens)), None, tuple(c_tokens), BS),
    ]
    run(bm, 3, list(range(300, 308)))  # 2 more blocks: a's second, then its first, are evicted
    events = bm.take_kv_events()
    assert events[:2] == [BlockRemoved((a_hashes[1],)), BlockRemoved((a_hashes[0],))]
    assert events[2:] == [BlockStored(tuple(chain(list(range(300, 308)))), None, tuple(range(300, 308)), BS)]


def test_reset_clears_an_idle_cache_and_is_refused_while_blocks_are_held():
    bm = manager()
    seq = run(bm, 0, list(range(8)))
    bm.take_kv_events()
    assert bm.reset_prefix_cache() is False  # the sequence holds cached blocks
    assert bm.take_kv_events() == [] and bm.gpu.num_cached == 2
    bm.free(seq)
    assert bm.reset_prefix_cache() is True
    assert bm.take_kv_events() == [AllBlocksCleared()]
    assert bm.gpu.num_cached == 0 and bm.gpu.num_free == bm.gpu.num_blocks
    again = run(bm, 1, list(range(8)))  # nothing cached any more: computed again, stored again
    assert bm.take_kv_events() == [BlockStored(tuple(chain(list(range(8)))), None, tuple(range(8)), BS)]
    assert again.num_computed_tokens == 8


def test_blocks_filled_by_decoding_are_stored_under_the_last_prompt_block():
    bm = manager()
    seq = run(bm, 0, list(range(6)))
    first = bm.take_kv_events()
    for token in (6, 7, 8):
        seq.append_token(token, 0.0, None)
        bm.append_slots(seq)
        seq.num_computed_tokens += 1
        bm.mark_computed(seq)
    hashes = chain(list(range(9)))
    assert first == [BlockStored((hashes[0],), None, (0, 1, 2, 3), BS)]
    assert bm.take_kv_events() == [BlockStored((hashes[1],), hashes[0], (4, 5, 6, 7), BS)]


def test_a_block_whose_key_another_block_holds_is_not_stored_twice():
    bm = manager(num_gpu=8)
    tokens = list(range(8))
    first, second = Sequence(0, tokens), Sequence(1, tokens)
    first.num_computed_tokens = bm.allocate(first)
    second.num_computed_tokens = bm.allocate(
        second
    )  # admitted before the first computed anything: nothing to share yet
    for seq in (first, second):
        seq.num_computed_tokens = 8
        bm.mark_computed(seq)
    assert bm.take_kv_events() == [BlockStored(tuple(chain(tokens)), None, tuple(tokens), BS)]


def test_runs_of_new_blocks_each_name_their_parent():
    keys = [bytes([i]) * 32 for i in range(5)]
    tokens = list(range(20))
    events = blocks_stored(keys, tokens, BS, [1, 2, 4])
    assert events == [
        BlockStored((external_hash(keys[1]), external_hash(keys[2])), external_hash(keys[0]), tuple(range(4, 12)), BS),
        BlockStored((external_hash(keys[4]),), external_hash(keys[3]), tuple(range(16, 20)), BS),
    ]


def test_nothing_is_recorded_unless_asked_or_without_prefix_caching():
    quiet = manager(events=False)
    run(quiet, 0, list(range(8)))
    assert quiet.kv_events is None and quiet.take_kv_events() == []
    uncached = BlockManager(BS, 6, 4, enable_prefix_caching=False, watermark=0.0, kv_events=True)
    run(uncached, 0, list(range(8)))
    assert uncached.take_kv_events() == []
