"""Block manager: exact block ids, reference counts, copy-on-write, swapping, prefix cache."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.server.core.block_manager import AllocStatus, BlockManager
from pagedllm.server.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, external_hash
from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.sampling_params import SamplingParams


def make_group(seq_id: int, num_tokens: int, request_id: str = "r") -> SequenceGroup:
    return SequenceGroup(request_id, [Sequence(seq_id, list(range(num_tokens)))], SamplingParams())


def make_manager(num_gpu=8, num_cpu=8, block_size=4, caching=False, window=None) -> BlockManager:
    return BlockManager(
        block_size, num_gpu, num_cpu, enable_prefix_caching=caching, watermark=0.0, sliding_window=window
    )


def advance(bm: BlockManager, seq: Sequence, tokens: int) -> list[tuple[int, int]]:
    """Append and compute ``tokens`` new tokens one step at a time, as decoding does; the copies made."""
    copies = []
    for _ in range(tokens):
        seq.append_token(1000 + len(seq), 0.0, None)
        copies += bm.append_slots(seq)
        seq.num_computed_tokens = len(seq)
        bm.mark_computed(seq)
    return copies


def test_allocate_append_and_free_exact_ids():
    bm = make_manager()
    group = make_group(0, 6)
    seq = group.seqs[0]
    assert bm.can_allocate(group) == AllocStatus.OK
    seq.num_computed_tokens = bm.allocate(seq)
    assert bm.block_table(seq) == [0, 1]
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = 6
    for token in (6, 7):  # fills block 1
        seq.append_token(token, 0.0, None)
        assert bm.append_slots(seq) == []
        seq.num_computed_tokens += 1
    seq.append_token(8, 0.0, None)
    assert bm.append_slots(seq) == []
    assert bm.block_table(seq) == [0, 1, 2]
    bm.free(seq)
    assert bm.gpu.num_free == 8


def test_fork_shares_and_copy_on_write_copies_only_the_last_block():
    bm = make_manager()
    parent = make_group(0, 6).seqs[0]
    parent.num_computed_tokens = bm.allocate(parent)
    parent.num_computed_tokens = 6
    child = parent.fork(1)
    bm.fork(parent, child)
    assert bm.gpu.ref_counts[0] == bm.gpu.ref_counts[1] == 2
    parent.append_token(100, 0.0, None)
    child.append_token(200, 0.0, None)
    assert bm.append_slots(parent) == [(1, 2)]  # shared partial block copied once
    assert bm.append_slots(child) == []  # now the sole owner of block 1
    assert bm.block_table(parent) == [0, 2] and bm.block_table(child) == [0, 1]
    assert bm.gpu.ref_counts[:3] == [2, 1, 1]


def test_never_and_later():
    bm = make_manager(num_gpu=4)
    assert bm.can_allocate(make_group(0, 17)) == AllocStatus.NEVER
    bm.allocate(make_group(1, 12).seqs[0])
    assert bm.can_allocate(make_group(2, 8)) == AllocStatus.LATER


def test_swap_out_and_in_moves_shared_blocks_once():
    bm = make_manager()
    group = make_group(0, 6)
    parent = group.seqs[0]
    parent.num_computed_tokens = bm.allocate(parent)
    parent.status = SequenceStatus.RUNNING
    child = parent.fork(1)
    bm.fork(parent, child)
    group.seqs.append(child)
    mapping = bm.swap_out(group)
    assert mapping == [(0, 0), (1, 1)]
    assert bm.gpu.num_free == 8 and bm.cpu.ref_counts[:2] == [2, 2]
    for seq in group.seqs:
        seq.status = SequenceStatus.SWAPPED
    assert bm.can_swap_in(group) == AllocStatus.OK
    back = bm.swap_in(group)
    assert [h for h, _ in back] == [0, 1]
    assert bm.cpu.num_free == 8


def test_prefix_cache_reuses_full_blocks_and_evicts_lru():
    bm = make_manager(num_gpu=4, caching=True)
    a = Sequence(0, list(range(9)))
    a.num_computed_tokens = bm.allocate(a)
    a.num_computed_tokens = 9
    bm.mark_computed(a)  # blocks 0 and 1 are full and cached
    b = Sequence(1, list(range(8)) + [99])
    b.num_computed_tokens = bm.allocate(b)
    assert bm.block_table(b)[:2] == bm.block_table(a)[:2]
    assert b.num_computed_tokens == 8
    bm.free(a)
    bm.free(b)
    assert bm.gpu.num_free == 4 and bm.gpu.num_cached == 2
    # Exactly-cached prompt: the last block is recomputed so the step has logits.
    c = Sequence(2, list(range(8)))
    c.num_computed_tokens = bm.allocate(c)
    assert c.num_computed_tokens == 4
    bm.free(c)


def test_table_version_changes_unless_the_table_only_grows():
    bm = make_manager(num_gpu=12)
    group = make_group(0, 4)
    seq = group.seqs[0]
    seq.num_computed_tokens = bm.allocate(seq)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = 4
    first = bm.table_versions[0]
    seq.append_token(1, 0.0, None)
    bm.append_slots(seq)  # a new block at the end: same version
    assert bm.block_table(seq) == [0, 1] and bm.table_versions[0] == first
    child = seq.fork(1)
    bm.fork(seq, child)
    assert bm.table_versions[1] not in (first, None)
    seq.num_computed_tokens = 5
    seq.append_token(1, 0.0, None)
    assert bm.append_slots(seq) == [(1, 2)]  # copy-on-write replaces the last block
    assert bm.table_versions[0] > bm.table_versions[1] > first
    before = bm.table_versions[0]
    bm.swap_out(group)
    assert bm.table_versions[0] > before
    bm.free(seq)
    assert 0 not in bm.table_versions
    bm.free(child)
    seq.reset_for_recompute()
    seq.num_computed_tokens = bm.allocate(seq)  # re-admitted after recompute preemption: never an old stamp
    assert bm.table_versions[0] > before


def test_blocks_behind_the_window_are_freed_exact_ids():
    """Window 6, blocks of 4: the next query at q sees q-5..q, so block i is dead once 4i+3 < q-5."""
    bm = make_manager(window=6)
    seq = make_group(0, 10).seqs[0]
    seq.num_computed_tokens = bm.allocate(seq)
    assert bm.block_table(seq) == [0, 1, 2] and bm.num_window_frees == 0  # nothing computed yet
    seq.num_computed_tokens = 10
    version = bm.table_versions[0]
    bm.mark_computed(seq)  # next query at 10 sees 5..10: block 0 (0..3) is dead
    assert bm.block_table(seq) == [0, 1, 2] and bm.held_blocks(seq) == [1, 2]
    assert bm.gpu.ref_counts[:3] == [0, 1, 1] and list(bm.gpu._free) == [3, 4, 5, 6, 7, 0]
    assert bm.table_versions[0] == version  # entries unchanged: a mirrored table stays valid
    advance(bm, seq, 2)  # next query at 12 sees 7..12: block 1 (4..7) still needed
    assert bm.held_blocks(seq) == [1, 2] and bm.num_window_frees == 1
    advance(bm, seq, 1)  # position 12 took block 3; next query at 13 sees 8..13: block 1 is dead
    assert bm.block_table(seq) == [0, 1, 2, 3] and bm.held_blocks(seq) == [2, 3]
    assert list(bm.gpu._free) == [4, 5, 6, 7, 0, 1] and bm.num_window_frees == 2
    assert bm.sharing_stats().used == 2 and bm.sharing_stats().unshared == 2
    assert bm.check_invariants() == []
    bm.free(seq)
    assert bm.gpu.num_free == 8 and list(bm.gpu._free) == [4, 5, 6, 7, 0, 1, 3, 2]


def test_a_window_of_one_keeps_only_the_current_block():
    bm = make_manager(window=1)
    seq = make_group(0, 9).seqs[0]
    seq.num_computed_tokens = bm.allocate(seq)
    seq.num_computed_tokens = 9
    bm.mark_computed(seq)  # next query at 9 sees only 9 (block 2)
    assert bm.held_blocks(seq) == [2]
    advance(bm, seq, 2)  # positions 9, 10 in block 2
    assert bm.held_blocks(seq) == [2]
    advance(bm, seq, 1)  # position 11 ends block 2: the next query, at 12, needs only the block to come
    assert bm.block_table(seq) == [0, 1, 2] and bm.held_blocks(seq) == [] and bm.gpu.num_free == 8
    advance(bm, seq, 1)
    assert bm.block_table(seq) == [0, 1, 2, 3] and bm.held_blocks(seq) == [3] and bm.gpu.num_free == 7


def test_no_window_frees_nothing():
    bm = make_manager()
    seq = make_group(0, 10).seqs[0]
    seq.num_computed_tokens = bm.allocate(seq)
    seq.num_computed_tokens = 10
    bm.mark_computed(seq)
    advance(bm, seq, 20)
    assert bm.held_blocks(seq) == bm.block_table(seq) == list(range(8)) and bm.num_window_frees == 0


def test_freed_cached_blocks_stay_in_the_prefix_cache():
    """A block out of the window goes to the evictable list like any freed cached block, and
    a later prompt with the same prefix takes it back."""
    bm = make_manager(caching=True, window=6)
    a = Sequence(0, list(range(12)))
    a.num_computed_tokens = bm.allocate(a)
    a.num_computed_tokens = 12
    bm.mark_computed(a)  # 3 full blocks cached; next query at 12 sees 7..12: block 0 is dead
    assert bm.held_blocks(a) == [1, 2] and bm.gpu.num_cached == 3
    assert bm.gpu.ref_counts[0] == 0 and list(bm.gpu._evictable) == [0] and bm.gpu.num_free == 6
    b = Sequence(1, list(range(8)) + [99, 98])
    b.num_computed_tokens = bm.allocate(b)  # blocks 0 (revived) and 1 (shared) from the cache; 8 tokens computed
    assert bm.block_table(b) == [0, 1, 3] and b.num_computed_tokens == 8
    assert bm.held_blocks(b) == [0, 1, 3]  # its next query at 8 sees 3..8: block 0 still needed
    assert bm.gpu.ref_counts[:4] == [1, 2, 1, 1]
    c = Sequence(2, list(range(12)) + [5])
    c.num_computed_tokens = bm.allocate(
        c
    )  # 12 tokens cached: its next query at 12 needs nothing before 7, so block 0 is dropped at once
    assert bm.block_table(c) == [0, 1, 2, 4] and bm.held_blocks(c) == [1, 2, 4]
    assert bm.gpu.ref_counts[:5] == [1, 3, 2, 1, 1] and bm.num_window_frees == 2
    assert bm.check_invariants() == []
    for seq in (a, b, c):
        bm.free(seq)
    assert bm.gpu.num_free == 8 and bm.gpu.num_cached == 3


def test_with_caching_a_block_is_kept_until_the_next_one_is_cached():
    """A full block is cached naming the block before it: a window within one block keeps
    that block until the next one is full and cached (one block more than the window needs)."""
    cached, plain = make_manager(caching=True, window=2), make_manager(window=2)
    seqs = [Sequence(0, list(range(5))), Sequence(0, list(range(5)))]
    for bm, seq in zip((cached, plain), seqs):
        seq.num_computed_tokens = bm.allocate(seq)
        seq.num_computed_tokens = 5
        bm.mark_computed(seq)  # next query at 5 sees 4..5: block 0 is dead
    assert plain.held_blocks(seqs[1]) == [1]
    assert cached.held_blocks(seqs[0]) == [0, 1] and cached.gpu.num_cached == 1
    advance(cached, seqs[0], 2)  # 7 computed: block 1 not full yet
    assert cached.held_blocks(seqs[0]) == [0, 1]
    advance(cached, seqs[0], 1)  # 8 computed: block 1 full and cached, so block 0 goes
    assert cached.held_blocks(seqs[0]) == [1] and cached.gpu.num_cached == 2
    assert list(cached.gpu._evictable) == [0] and cached.check_invariants() == []


def test_fork_shares_only_held_blocks_and_a_dead_block_returns_when_both_drop_it():
    bm = make_manager(window=6)
    parent = make_group(0, 10).seqs[0]
    parent.num_computed_tokens = bm.allocate(parent)
    parent.num_computed_tokens = 10
    bm.mark_computed(parent)  # block 0 freed
    child = parent.fork(1)
    bm.fork(parent, child)
    assert bm.block_table(child) == [0, 1, 2] and bm.held_blocks(child) == [1, 2]
    assert bm.gpu.ref_counts[:3] == [0, 2, 2]
    assert advance(bm, parent, 1) == [(2, 3)]  # copy-on-write of the shared last block
    advance(bm, parent, 2)  # position 12 in block 4; next query at 13 drops block 1
    assert bm.block_table(parent) == [0, 1, 3, 4] and bm.held_blocks(parent) == [3, 4]
    assert bm.gpu.ref_counts[:5] == [0, 1, 1, 1, 1]  # the child still holds blocks 1 and 2
    assert bm.check_invariants() == []
    bm.free(child)
    assert bm.gpu.ref_counts[:3] == [0, 0, 0]
    bm.free(parent)
    assert bm.gpu.num_free == 8 and bm.check_invariants() == []


def test_swap_moves_only_held_blocks():
    bm = make_manager(window=6)
    group = make_group(0, 10)
    seq = group.seqs[0]
    seq.num_computed_tokens = bm.allocate(seq)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = 10
    bm.mark_computed(seq)  # block 0 freed: free list [3, 4, 5, 6, 7, 0]
    assert bm.can_swap_out(group)
    assert bm.swap_out(group) == [(1, 0), (2, 1)]
    seq.status = SequenceStatus.SWAPPED
    assert bm.gpu.num_free == 8 and bm.cpu.ref_counts[:3] == [1, 1, 0]
    assert bm.check_invariants() == []
    assert bm.swap_in(group) == [(0, 3), (1, 4)]
    seq.status = SequenceStatus.RUNNING
    assert bm.block_table(seq) == [0, 3, 4] and bm.held_blocks(seq) == [3, 4]
    assert bm.cpu.num_free == 8 and bm.check_invariants() == []
    advance(bm, seq, 3)  # goes on decoding from the moved blocks
    assert bm.held_blocks(seq) == [4, 5]
    bm.free(seq)
    assert bm.gpu.num_free == 8


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / swap / reset keep reference counts exact,
    and a subscriber that replays the KV events knows exactly which hashes are cached."""

    WINDOW: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(
            block_size=2,
            num_gpu_blocks=12,
            num_cpu_blocks=12,
            enable_prefix_caching=True,
            watermark=0.0,
            sliding_window=self.WINDOW,
            kv_events=True,
        )
        self.subscriber: set[int] = set()  # the hashes a router following the events believes cached
        self.groups: list[SequenceGroup] = []
        self.next_id = 0
        self.mirrors: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (version, table) last seen

    def _running(self):
        return [g for g in self.groups if g.seqs[0].status == SequenceStatus.RUNNING]

    @rule(length=st.integers(1, 7), shared=st.booleans())
    def allocate(self, length, shared):
        tokens = list(range(length)) if shared else [self.next_id * 10 + i for i in range(length)]
        group = SequenceGroup(str(self.next_id), [Sequence(self.next_id, tokens)], SamplingParams())
        self.next_id += 1
        if self.bm.can_allocate(group) != AllocStatus.OK:
            return
        group.seqs[0].num_computed_tokens = self.bm.allocate(group.seqs[0])
        group.seqs[0].status = SequenceStatus.RUNNING
        group.seqs[0].num_computed_tokens = length
        self.bm.mark_computed(group.seqs[0])
        self.groups.append(group)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def append(self, data):
        group = data.draw(st.sampled_from(self._running()))
        for seq in group.seqs:
            seq.append_token(7, 0.0, None)
        if not self.bm.can_append_slots(group.running_seqs()):
            for seq in group.seqs:
                seq.output_token_ids.pop()
                seq.token_ids.pop()
            return
        for seq in group.seqs:
            self.bm.append_slots(seq)
            seq.num_computed_tokens = len(seq)
            self.bm.mark_computed(seq)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def fork(self, data):
        group = data.draw(st.sampled_from(self._running()))
        child = group.seqs[0].fork(self.next_id)
        self.next_id += 1
        self.bm.fork(group.seqs[0], child)
        group.seqs.append(child)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def free(self, data):
        group = data.draw(st.sampled_from(self.groups))
        for seq in group.seqs:
            self.bm.free(seq)
        self.groups.remove(group)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.sampled_from(self._running()))
        if self.bm.can_swap_out(group):
            self.bm.swap_out(group)
            for seq in group.seqs:
                seq.status = SequenceStatus.SWAPPED

    @precondition(lambda self: any(g.seqs[0].status == SequenceStatus.SWAPPED for g in self.groups))
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.sampled_from([g for g in self.groups if g.seqs[0].status == SequenceStatus.SWAPPED]))
        if self.bm.can_swap_in(group) == AllocStatus.OK:
            self.bm.swap_in(group)
            for seq in group.seqs:
                seq.status = SequenceStatus.RUNNING

    @rule()
    def reset_prefix_cache(self):
        held = any(self.bm.gpu.ref_counts)
        assert self.bm.reset_prefix_cache() is not held

    @invariant()
    def replayed_events_name_exactly_the_cached_blocks(self):
        for event in self.bm.take_kv_events():
            if isinstance(event, BlockStored):
                assert event.parent_block_hash is None or event.parent_block_hash in self.subscriber
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                assert not self.subscriber & set(event.block_hashes), "stored twice"
                self.subscriber.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.subscriber, "removed without being stored"
                self.subscriber.difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.subscriber.clear()
        assert self.subscriber == {external_hash(h) for h in self.bm.gpu._hash_to_block}

    @invariant()
    def ref_counts_equal_tables_holding_each_block(self):
        for pool, on_host in ((self.bm.gpu, False), (self.bm.cpu, True)):
            holders = Counter()
            for group in self.groups:
                if (group.seqs[0].status == SequenceStatus.SWAPPED) == on_host:
                    for seq in group.seqs:
                        holders.update(self.bm.held_blocks(seq))
            assert [pool.ref_counts[b] for b in range(pool.num_blocks)] == [holders[b] for b in range(pool.num_blocks)]
            assert pool.num_free == pool.num_blocks - len(holders)

    @invariant()
    def an_unchanged_version_means_the_table_only_grew(self):
        assert self.bm.table_versions.keys() == self.bm.tables.keys()
        for seq_id, table in self.bm.tables.items():
            version = self.bm.table_versions[seq_id]
            seen = self.mirrors.get(seq_id)
            if seen is not None and seen[0] == version:
                assert table[: len(seen[1])] == seen[1], (seq_id, seen, table)
            self.mirrors[seq_id] = (version, list(table))

    @invariant()
    def free_and_evictable_blocks_are_unused(self):
        pool = self.bm.gpu
        idle = list(pool._free) + list(pool._evictable)
        assert len(idle) == len(set(idle))
        assert all(pool.ref_counts[b] == 0 for b in idle)

    def teardown(self):
        for group in self.groups:
            for seq in group.seqs:
                self.bm.free(seq)
        assert self.bm.gpu.num_free == self.bm.gpu.num_blocks
        assert self.bm.cpu.num_free == self.bm.cpu.num_blocks

    @invariant()
    def a_window_leaves_only_the_blocks_the_next_query_needs(self):
        if self.WINDOW is None:
            return
        for group in self.groups:
            for seq in group.seqs:
                first_seen = max(0, seq.num_computed_tokens - self.WINDOW + 1)
                held = len(self.bm.held_blocks(seq))
                # blocks from the window's first one to the last, plus one kept for the prefix cache
                assert held <= -(-len(seq) // 2) - first_seen // 2 + 1


class WindowedBlockManagerMachine(BlockManagerMachine):
    """The same, with blocks freed behind a window of 3 positions (blocks of 2)."""

    WINDOW = 3


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestWindowedBlockManagerMachine = WindowedBlockManagerMachine.TestCase
TestWindowedBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
