"""Per-sequence block tables: logical block -> physical block, with version stamps.

Logical block ``i`` of a sequence holds token positions ``[i*B, (i+1)*B)``; its table
maps it to a physical block of the device pool (or the host pool while swapped out)::

    seq tokens:   t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9        (block_size B = 4)
    logical:          0       |     1       |   2
    table:        [    7      ,     3       ,   12  ]      slot of t9 = 12*4 + 1

Leading entries freed as out of a sliding window stay in the table, stale, so that
position p still maps to ``table[p // B]``; the blocks a sequence holds start past them.
"""

from __future__ import annotations

from pagedllm.server.core.block_pool import BlockPool


class BlockTables:
    """Which physical blocks each sequence's table names, and which of them it still holds.

    NOTE: only the block manager changes these tables; everything else reads them.
    """

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}
        self.versions: dict[int, int] = {}
        """seq_id -> a stamp that changes whenever the sequence's table changes other than by appending.

        NOTE: a worker that mirrors block tables across steps may keep its copy of a table
        while the stamp is unchanged and write only the entries past its copy's length:
        between two equal stamps the table only grew at its end. Stamps come from one
        counter and are never reused, so a sequence freed and allocated again (recompute
        preemption) or a table rebuilt in place (copy-on-write, swap) always gets a new one.
        """
        self._version_counter = 0
        self.on_host: set[int] = set()
        """Sequences whose table holds host blocks (swapped out)."""
        self.num_freed: dict[int, int] = {}
        """seq_id -> leading table entries freed as out of the window (absent: none).

        NOTE: those entries are stale ids the sequence no longer holds; everything that
        walks a table for the blocks it holds (free, fork, swap, caching, accounting)
        starts past them. Attention does not read them: it starts at the window.
        """

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def add(self, seq_id: int, table: list[int]) -> None:
        self.tables[seq_id] = table
        self.rewritten(seq_id)

    def rewritten(self, seq_id: int) -> None:
        """Record that the table of ``seq_id`` changed other than by appending (see :attr:`versions`)."""
        self._version_counter += 1
        self.versions[seq_id] = self._version_counter

    def first_held(self, seq_id: int) -> int:
        """The index of the table's first entry the sequence still holds."""
        return self.num_freed.get(seq_id, 0)

    def held(self, seq_id: int) -> list[int]:
        """The blocks the sequence holds: its table less the entries freed as out of the window."""
        return self.tables[seq_id][self.first_held(seq_id) :]

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child gets a copy of the parent's table (its freed entries stay freed)."""
        self.add(child_id, list(self.tables[parent_id]))
        if parent_id in self.num_freed:
            self.num_freed[child_id] = self.num_freed[parent_id]

    def remove(self, seq_id: int) -> list[int] | None:
        """Forget the sequence's table: the blocks it held, or None when it had none."""
        held = self.held(seq_id) if seq_id in self.tables else None
        self.tables.pop(seq_id, None)
        self.versions.pop(seq_id, None)
        self.num_freed.pop(seq_id, None)
        return held

    def move(self, seq_ids: list[int], src: BlockPool, dst: BlockPool, to_host: bool) -> list[tuple[int, int]]:
        """Move the held blocks of ``seq_ids`` from ``src`` to ``dst``: the (src, dst) block pairs.

        NOTE: a block the sequences share moves once, and its copy gains one reference per holder.
        """
        mapping: dict[int, int] = {}
        for seq_id in seq_ids:
            table = self.tables[seq_id]
            for i in range(self.first_held(seq_id), len(table)):
                block = table[i]
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                src.decref(block)
                table[i] = mapping[block]
            self.rewritten(seq_id)
            if to_host:
                self.on_host.add(seq_id)
            else:
                self.on_host.discard(seq_id)
        return list(mapping.items())

    def held_counts(self, num_blocks: int, host: bool) -> list[int]:
        """How many tables hold each block of the device pool (``host`` False) or of the host pool."""
        held = [0] * num_blocks
        for seq_id in self.tables:
            if (seq_id in self.on_host) == host:
                for block in self.held(seq_id):
                    held[block] += 1
        return held

    def device_held(self) -> list[list[int]]:
        """The blocks each sequence on the device holds."""
        return [self.held(seq_id) for seq_id in self.tables if seq_id not in self.on_host]
