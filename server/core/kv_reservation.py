"""Reservation-based KV allocation, the paper's Orca baselines, for benchmarks only.

A reservation-based server gives each request, at admission, room for every token it
may ever hold, because its cache is one contiguous range per request. The paper
compares paging with three such policies (section 6.1 of Kwon et al., 2023):

    Orca (Max)     reserve max_model_len tokens
    Orca (Pow2)    reserve the next power of two of prompt + output (at most max_model_len)
    Orca (Oracle)  reserve exactly prompt + output (it knows the output length)

Here the reservation is counted in blocks, so the comparison isolates what reserving
costs (room held for tokens not yet, or never, generated) from everything else: the
scheduler, model and sampling are the engine's own. External fragmentation of a real
contiguous allocator is not modelled, which flatters the baselines.

NOTE: a reserved block is not taken from the pool at admission; the reservation is a
count. ``outstanding`` is the number of blocks promised to admitted sequences and not
yet allocated; the block manager treats them as unavailable to anyone else, and a
sequence's own allocations draw its promise down first.

    pool:   [ allocated ......... | outstanding (promised) | free for new requests ]
"""

from __future__ import annotations

KV_RESERVATIONS = ("paged", "max", "pow2", "oracle")


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class KVReservation:
    """Blocks each sequence holds from admission, and how many are promised but not yet allocated."""

    def __init__(self, mode: str, block_size: int, max_model_len: int) -> None:
        if mode not in KV_RESERVATIONS[1:]:
            raise ValueError(f"kv reservation mode={mode!r}: choose one of {list(KV_RESERVATIONS[1:])}")
        self.mode = mode
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._final_len: dict[int, int] = {}  # seq_id -> prompt + output, told by the engine
        self._left: dict[int, int] = {}  # seq_id -> blocks promised and not yet allocated
        self.outstanding = 0

    def reserved_tokens(self, final_len: int) -> int:
        """Token slots a request whose prompt + output is ``final_len`` reserves."""
        final = min(final_len, self.max_model_len)
        if self.mode == "max":
            return self.max_model_len
        if self.mode == "pow2":
            return min(_next_pow2(final), self.max_model_len)
        return final

    def expect(self, seq_id: int, final_len: int) -> None:
        """Record how long the sequence can grow (prompt + max_tokens)."""
        self._final_len[seq_id] = final_len

    def blocks(self, seq_id: int) -> int:
        """Blocks the sequence holds from admission; 0 for one the engine did not describe."""
        final = self._final_len.get(seq_id)
        return 0 if final is None else -(-self.reserved_tokens(final) // self.block_size)

    def hold(self, seq_id: int, allocated: int) -> None:
        """The sequence was admitted holding ``allocated`` blocks: promise it the rest of its reservation."""
        left = max(0, self.blocks(seq_id) - allocated)
        self._left[seq_id] = left
        self.outstanding += left

    def left(self, seq_id: int) -> int:
        """Blocks promised to the sequence and not yet allocated."""
        return self._left.get(seq_id, 0)

    def draw(self, seq_id: int) -> None:
        """The sequence allocated one block: it comes out of its promise, if any is left."""
        if self._left.get(seq_id, 0) > 0:
            self._left[seq_id] -= 1
            self.outstanding -= 1

    def release(self, seq_id: int, finished: bool) -> None:
        """The sequence gave its blocks back (finished, or preempted to be recomputed)."""
        self.outstanding -= self._left.pop(seq_id, 0)
        if finished:
            self._final_len.pop(seq_id, None)
