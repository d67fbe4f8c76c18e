"""What the workers know of each sequence, so that a step sends them only what changed.

:class:`WorkerView` turns the scheduler's step (live groups: :class:`ScheduledStep`) into the
frozen, id-keyed :class:`~pagedllm.server.core.scheduler_output.SchedulerOutput`. Per sequence
the workers know, it remembers how many tokens and table entries were sent and the table's
version when they were::

    known[seq] = [tokens sent, table version, table entries sent, LoRA slot]

A scheduled sequence it does not know goes out whole (:class:`NewSeqData`); one it knows gets
its new tokens, its new table entries (the whole table when the version changed) and its
computed count. Sequences whose tables are gone (finished, aborted, recomputed) are listed
once in ``finished_seq_ids``. After a failed step :meth:`forget_all` makes the next output
tell the workers to drop everything, and every sequence goes out whole again.

NOTE: per step the work is one pass over the scheduled sequences, each sending only its new
tokens and blocks (a decode: one token, and a block every ``block_size`` steps).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedllm.server.core.block_manager import BlockManager
from pagedllm.server.core.scheduler_output import CachedSeqs, NewSeqData, SchedulerOutput
from pagedllm.server.core.sequence import Sequence, SequenceGroup

if TYPE_CHECKING:
    from pagedllm.server.core.scheduler import ScheduledStep

Entry = tuple[SequenceGroup, Sequence, int]
"""A sequence in the step and how many new tokens it computes."""


def split_step(out: ScheduledStep) -> tuple[list[Entry], list[Entry], list[Entry]]:
    """The step's single-token sequences, its sequences verifying proposals and its longer chunks,
    each in scheduled order (the step's token order is decodes, verifications, prefill chunks)."""
    decodes: list[Entry] = []
    verifies: list[Entry] = []
    prefills: list[Entry] = []
    for item in out.scheduled:
        for seq in item.group.seqs:
            chunk = item.chunks.get(seq.seq_id)
            if not chunk:
                continue
            if chunk == 1:
                decodes.append((item.group, seq, chunk))
            elif seq.num_computed_tokens + chunk > len(seq.token_ids):
                verifies.append((item.group, seq, chunk))
            else:
                prefills.append((item.group, seq, chunk))
    return decodes, verifies, prefills


class WorkerView:
    """The scheduler's record of what the workers hold, and the diffs that keep them current."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self._known: dict[int, list[int]] = {}
        self._reset = False

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._known

    def forget_all(self) -> None:
        """The workers' state is unknown (a step failed): the next output resets them."""
        self._known.clear()
        self._reset = True

    def emit(
        self,
        out: ScheduledStep,
        entries: tuple[list[Entry], list[Entry], list[Entry]],
        sample_seq_ids: Iterable[int] = (),
        prompt_logprobs: Iterable[tuple[int, int]] = (),
        pooled: Iterable[tuple[int, int, int]] = (),
    ) -> SchedulerOutput:
        """The step as the workers get it (``entries``: :func:`split_step` of ``out``); records what it sends."""
        decodes, verifies, prefills = entries
        ordered = (*decodes, *verifies, *prefills) if verifies or prefills else decodes
        new, cached, scheduled = self._diffs(ordered, out.lora_slots)
        chunks = (1,) * len(decodes) if ordered is decodes else tuple([chunk for _, _, chunk in ordered])
        return SchedulerOutput(
            new_seqs=new,
            cached_seqs=cached,
            scheduled_seq_ids=scheduled,
            num_scheduled_tokens=chunks,
            num_decodes=len(decodes),
            num_verifies=len(verifies),
            spec_token_ids=tuple(tuple(seq.spec_token_ids) for _, seq, _ in verifies),
            sample_seq_ids=tuple(sample_seq_ids),
            prompt_logprobs=tuple(prompt_logprobs),
            pooled=tuple(pooled),
            finished_seq_ids=self._take_finished(),
            reset=self._take_reset(),
            swap_out=tuple(out.blocks_to_swap_out),
            swap_in=tuple(out.blocks_to_swap_in),
            copies=tuple(out.blocks_to_copy),
            lora_adapters=_adapters(out, ordered),
        )

    def _diffs(
        self, entries: Iterable[Entry], lora_slots: dict[int, int]
    ) -> tuple[tuple[NewSeqData, ...], CachedSeqs, tuple[int, ...]]:
        """Each sequence whole if the workers do not know it (in this LoRA slot), else what changed;
        and every sequence's id, in step order.

        NOTE: one pass, everything local: this runs for every sequence of every step.
        """
        tables, versions, known = self.block_manager.tables, self.block_manager.table_versions, self._known
        new: list[NewSeqData] = []
        scheduled: list[int] = []
        ids: list[int] = []
        new_tokens: list[tuple[int, ...]] = []
        new_blocks: list[tuple[int, ...]] = []
        replaced: list[bool] = []
        computed: list[int] = []
        for group, seq, _ in entries:
            seq_id = seq.seq_id
            scheduled.append(seq_id)
            table, tokens = tables[seq_id], seq.token_ids
            slot = lora_slots[group.lora_request.lora_int_id] if lora_slots and group.lora_request else 0
            sent = known.get(seq_id)
            if sent is None or sent[3] != slot:
                known[seq_id] = [len(tokens), versions[seq_id], len(table), slot]
                new.append(NewSeqData(seq_id, tuple(tokens), tuple(table), seq.num_computed_tokens, slot))
                continue
            num_tokens, num_blocks, version = len(tokens), len(table), versions[seq_id]
            new_tokens.append(tuple(tokens[sent[0] :]))
            if version != sent[1] or num_blocks < sent[2]:
                new_blocks.append(tuple(table))
                replaced.append(True)
                sent[1] = version
            else:
                new_blocks.append(tuple(table[sent[2] :]) if num_blocks != sent[2] else ())
                replaced.append(False)
            sent[0], sent[2] = num_tokens, num_blocks
            ids.append(seq_id)
            computed.append(seq.num_computed_tokens)
        cached = CachedSeqs(tuple(ids), tuple(new_tokens), tuple(new_blocks), tuple(replaced), tuple(computed))
        return tuple(new), cached, tuple(scheduled)

    def _take_finished(self) -> tuple[int, ...]:
        """Known sequences whose tables are gone since the last step; forgotten here."""
        gone = self._known.keys() - self.block_manager.tables.keys()
        for seq_id in gone:
            del self._known[seq_id]
        return tuple(sorted(gone))

    def _take_reset(self) -> bool:
        reset, self._reset = self._reset, False
        return reset


def _adapters(out: ScheduledStep, entries: Iterable[Entry]) -> tuple:
    """(slot, adapter) of each adapter the step's sequences use, by slot; () without adapters."""
    if not out.lora_slots:
        return ()
    adapters = {}
    for group, _, _ in entries:
        lora = group.lora_request
        if lora is not None:
            adapters[out.lora_slots[lora.lora_int_id]] = lora
    return tuple(sorted(adapters.items()))
