"""Iteration-level FCFS scheduling with chunked prefill, preemption and swapping.

Each call of :meth:`Scheduler.schedule` plans one model step, in this order:

1. running groups: decodes first, then prompts still being prefilled in chunks;
   when a sequence cannot get a block, the latest-arrived running group is preempted
   (recompute for single-sequence groups, swap for multi-sequence ones, or as
   ``preemption_mode`` forces);
2. swapped groups come back, oldest first, if nothing was preempted this step;
3. waiting prompts are admitted, oldest first, only when no group is swapped out.

A large burst of prompts that arrives while nothing decodes is admitted over two steps,
the first half's streams waiting for the second (:mod:`~pagedllm.server.core.prompt_burst`).

A prompt longer than the step's remaining token budget is prefilled over several
steps. Admission is strictly first-come-first-served on blocks, so a large prompt
waits only until enough running sequences finish, never behind later arrivals.

After the step, :meth:`Scheduler.update_from_output` applies what the step decided
(:mod:`~pagedllm.server.core.sequence_updates`) and frees what finished: with the
scheduling above, the only code that changes a sequence.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.server.config import SchedulerConfig
from pagedllm.server.core.block_manager import AllocStatus, BlockManager
from pagedllm.server.core.lora_slots import LoRASlots
from pagedllm.server.core.prompt_burst import PromptBurst, in_first_half, prompt_tokens
from pagedllm.server.core.sequence import FINISHED, Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.core.sequence_updates import SequenceUpdater, StepUpdates
from pagedllm.server.core.step_budget import StepBudget, any_prefill
from pagedllm.server.core.worker_view import WorkerView


@dataclass(slots=True)
class ScheduledGroup:
    """A group in this step and how many new tokens each of its sequences computes."""

    group: SequenceGroup
    chunks: dict[int, int]  # seq_id -> number of tokens computed this step


@dataclass
class ScheduledStep:
    """What one model step does: which tokens to compute and which blocks to move first.

    The scheduler's own view, holding live groups; the workers get the frozen, id-keyed
    :class:`~pagedllm.server.core.scheduler_output.SchedulerOutput` made from it (:attr:`Scheduler.worker_view`).
    """

    scheduled: list[ScheduledGroup] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[SequenceGroup] = field(default_factory=list)
    ignored: list[SequenceGroup] = field(default_factory=list)
    lora_slots: dict[int, int] = field(default_factory=dict)
    """LoRA adapter id -> its slot, for the adapters of this step's groups."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in


class Scheduler:
    """Owns the waiting, running and swapped queues and asks the block manager for room."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, loras: LoRASlots | None = None) -> None:
        self.config = config
        self.loras = loras
        """The LoRA adapter slots (None without LoRA): a request holds its adapter's from admission to its end."""
        self.token_budget = config.token_budget  # NOTE: resolved for the device by the engine
        self.block_manager = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # NOTE: kept in arrival order
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        self.updater = SequenceUpdater(block_manager)
        """Applies what a step decided to sequences and groups: the one writer of their state."""
        self.worker_view = WorkerView(block_manager)
        """What the workers know of each sequence: each step's output carries only what changed."""
        self.burst = PromptBurst(config.prompt_burst_split_tokens or 0, config.max_num_seqs)

    # -- queues -------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request_ids: Iterable[str]) -> list[SequenceGroup]:
        """Remove the requests wherever they are and free their blocks."""
        wanted = set(request_ids)
        aborted = []
        for queue in (self.waiting, self.running, self.swapped):
            for group in [g for g in queue if g.request_id in wanted]:
                queue.remove(group)
                for seq in group.unfinished_seqs():
                    seq.status = SequenceStatus.FINISHED_ABORTED
                    self.block_manager.free(seq)
                self._release_lora(group)
                aborted.append(group)
        return aborted

    def free_finished(self) -> list[SequenceGroup]:
        """Release finished sequences' blocks; return the groups that are now done."""
        done = []
        for group in self.running:
            for seq in group.seqs:
                if seq.status in FINISHED:
                    self.block_manager.free(seq)  # NOTE: a no-op once its blocks are gone
            if group.is_finished():
                done.append(group)
                self._release_lora(group)
        if done:
            finished = set(map(id, done))
            self.running = [g for g in self.running if id(g) not in finished]
        return done

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        out = ScheduledStep()
        burst, held = self.burst.plan(self.running, self.waiting, self.swapped, self.token_budget)
        budget = StepBudget.for_step(self.config, self.token_budget, self.running, self.waiting, held)
        skip = set(held)
        self._take_running([g for g in self.running if g not in skip], budget, out, dict.fromkeys(self.running))
        if not out.preempted:
            self._schedule_swapped(budget, out)
        admitted = []
        if not out.preempted and not self.swapped:
            admitted = self._schedule_waiting(budget, out, burst)
        if held and not admitted:  # NOTE: nothing more of the burst could start: its streams go on now
            budget.seqs -= sum(len(g.running_seqs()) for g in held)
            self._take_running(held, budget, out, dict.fromkeys(g for g in held if g in self.running))
        if burst is not None:
            self.burst.admitted(admitted)
        out.num_batched_tokens = budget.tokens
        now = time.monotonic()
        for item in out.scheduled:
            group = item.group
            if group.first_scheduled_time is None:
                group.first_scheduled_time = now
            if group.lora_request is not None and self.loras is not None:
                lora_id = group.lora_request.lora_int_id
                out.lora_slots[lora_id] = self.loras.slot_of[lora_id]
        return out

    def _take_running(self, groups: list[SequenceGroup], budget: StepBudget, out: ScheduledStep, pending: dict) -> None:
        """Schedule running ``groups``, decodes first, each in arrival order; a group short of room
        preempts the latest-arrived group still in ``pending`` (arrival order), itself included."""
        for group in sorted(groups, key=lambda g: any_prefill(g.running_seqs())):  # NOTE: stable
            if group not in pending:
                continue  # already preempted this step
            seqs = group.running_seqs()
            if (
                len(seqs) == 1
                and seqs[0].spec_token_ids
                and self._take_speculative(group, seqs[0], budget, out, pending)
            ):
                del pending[group]
                continue
            self._take(group, budget, out, seqs, pending)
            pending.pop(group, None)  # NOTE: scheduled or not, it is no longer a candidate for preemption

    def _take_speculative(
        self, group: SequenceGroup, seq: Sequence, budget: StepBudget, out: ScheduledStep, pending: dict
    ) -> bool:
        """A decode with proposals: its token and its proposals in one chunk, verified in one step.

        Proposals are optional: without room in the budget or the cache (less one block for
        each group still to schedule, so they never cause a preemption) they are dropped and
        False sends the sequence down the ordinary decode path.
        """
        chunk = 1 + len(seq.spec_token_ids)
        if (
            len(seq.token_ids) - seq.num_computed_tokens != 1
            or budget.seqs >= budget.max_seqs
            or budget.tokens + chunk > budget.max_tokens
            or self.block_manager.blocks_to_append([seq]) + len(pending) - 1 > self.block_manager.num_available
        ):
            seq.spec_token_ids = []
            return False
        copies = self.block_manager.append_slots(seq)
        assert copies is not None, "blocks_to_append counted the room"
        budget.tokens += chunk
        budget.seqs += 1
        out.blocks_to_copy.extend(copies)
        out.scheduled.append(ScheduledGroup(group, {seq.seq_id: chunk}))
        return True

    def _take(
        self,
        group: SequenceGroup,
        budget: StepBudget,
        out: ScheduledStep,
        seqs: list[Sequence],
        pending: dict | None = None,
    ) -> bool:
        """Give each sequence its chunk of the token budget and room in the cache; False: not this step.

        A running group (``pending`` given) makes room by preempting the latest arrivals still
        pending, itself included; a group just admitted or swapped in already has its room.
        """
        if not seqs or budget.seqs + len(seqs) > budget.max_seqs:
            return False
        chunks = budget.chunks(seqs, self.config.enable_chunked_prefill)
        if chunks is None:
            return False
        copies = self._append(group, seqs, pending, out)
        if copies is None:
            return False
        budget.tokens += sum(chunks.values())
        budget.seqs += len(seqs)
        if copies:
            out.blocks_to_copy.extend(copies)
        out.scheduled.append(ScheduledGroup(group, chunks))
        return True

    def _append(
        self, group: SequenceGroup, seqs: list[Sequence], pending: dict | None, out: ScheduledStep
    ) -> list[tuple[int, int]] | None:
        """Slots for the group's uncomputed tokens: its copy-on-write pairs; None if it was preempted.

        NOTE: one sequence's append is all or nothing by itself (a decode looks at one block);
        a group's sequences are counted together first, so none of them appends unless all can.
        """
        bm = self.block_manager
        while True:
            if len(seqs) == 1:
                copies = bm.append_slots(seqs[0])
                if copies is not None:
                    return copies
            elif bm.can_append_slots(seqs):
                return [pair for seq in seqs for pair in bm.append_slots(seq) or ()]
            assert pending, f"no room for request {group.request_id!r}, which was admitted with room"
            victim, _ = pending.popitem()
            self._preempt(victim, out)
            if victim is group:
                return None

    def _preempt(self, group: SequenceGroup, out: ScheduledStep) -> None:
        self.running.remove(group)
        for seq in group.seqs:
            seq.spec_token_ids = []  # NOTE: proposals hold slots only in the step that verifies them
        self.num_preemptions += 1
        out.preempted.append(group)
        mode = self.config.preemption_mode or ("swap" if group.is_multi_seq else "recompute")
        if mode == "swap" and self.block_manager.can_swap_out(group):
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(group))
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            return
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            self.block_manager.free(seq)
            seq.reset_for_recompute()
        self._release_lora(group)
        self.waiting.appendleft(group)

    def _schedule_swapped(self, budget: StepBudget, out: ScheduledStep) -> None:
        while self.swapped:
            group = self.swapped[0]
            status = self.block_manager.can_swap_in(group)
            if status == AllocStatus.NEVER:  # grew too large for the whole cache: end it
                self.swapped.popleft()
                self._give_up(group, SequenceStatus.SWAPPED, out)
                continue
            if status == AllocStatus.LATER:
                break
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            if budget.seqs + len(seqs) > budget.max_seqs or budget.tokens_left < len(seqs):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(group))
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            insert_by_arrival(self.running, group)
            self._take(group, budget, out, seqs)

    def _schedule_waiting(self, budget: StepBudget, out: ScheduledStep, burst: int | None) -> list[SequenceGroup]:
        """Admit waiting prompts, oldest first (the first half of a ``burst`` of that many prompt
        tokens, see :mod:`~pagedllm.server.core.prompt_burst`); return them."""
        admitted: list[SequenceGroup] = []
        start = budget.tokens
        while self.waiting and budget.tokens_left > 0:
            group = self.waiting[0]
            if burst is not None and admitted and not in_first_half(budget.tokens - start, prompt_tokens(group), burst):
                break
            seqs = group.get_seqs(SequenceStatus.WAITING)
            if budget.seqs + group.max_num_running_seqs > budget.max_seqs:
                break
            # NOTE: recomputed beams must restart from equal computed lengths (see _take).
            use_cache = not group.reads_every_prompt_position and not (
                group.sampling_params.use_beam_search and seqs[0].output_token_ids
            )
            if self.loras is not None and not self.loras.can_acquire(group.lora_request):
                break  # NOTE: every adapter slot has running users: wait, first come first served
            status = self.block_manager.can_allocate(group, use_cache)
            if status == AllocStatus.LATER:
                break
            self.waiting.popleft()
            if status == AllocStatus.NEVER:
                self._give_up(group, SequenceStatus.WAITING, out)
                continue
            for seq in seqs:
                seq.num_computed_tokens = self.block_manager.allocate(seq, use_cache)
                seq.status = SequenceStatus.RUNNING
            if self.loras is not None:
                self.loras.acquire(group.request_id, group.lora_request)
            if group.num_cached_tokens is None:
                # NOTE: right after allocate(), the computed tokens are exactly the cached prefix blocks.
                group.num_cached_tokens = seqs[0].num_computed_tokens
            insert_by_arrival(self.running, group)
            if not self._take(group, budget, out, seqs):
                break
            admitted.append(group)
        return admitted

    def _give_up(self, group: SequenceGroup, status: SequenceStatus, out: ScheduledStep) -> None:
        """A group larger than the whole cache finishes with what it has ("length")."""
        for seq in group.get_seqs(status):
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED_LENGTH
        self._release_lora(group)
        out.ignored.append(group)

    def _release_lora(self, group: SequenceGroup) -> None:
        if self.loras is not None:
            self.loras.release(group.request_id)

    # -- around the step: the one place sequences change --------------------------------
    def set_proposals(self, proposals: dict[int, list[int]]) -> None:
        """Give running sequences (seq id -> tokens) the proposals the coming step verifies."""
        self.updater.set_proposals(self.running, proposals)

    def update_from_output(
        self, out: ScheduledStep, updates: StepUpdates | None, failed: dict[str, str], advanced: bool = False
    ) -> list[SequenceGroup]:
        """Apply a step: computed chunks, then ``updates`` (None: the model step did not run), then
        abort the requests in ``failed`` (apply failures join them); return the groups now done.
        ``advanced``: the chunks were counted already, when the next step was scheduled ahead
        (:mod:`~pagedllm.server.core.lookahead`); only their blocks are cached now.

        NOTE: the only place requests and sequences change after a step (see :mod:`sequence_updates`).
        """
        if updates is not None:
            self.updater.mark_computed(out, advanced)
            self.updater.apply({item.group.request_id: item.group for item in out.scheduled}, updates, failed)
        if failed:
            self.abort(failed)
        return self.free_finished()

    def mark_computed(self, out: ScheduledStep) -> None:
        """Advance every scheduled sequence by its chunk and cache its completed blocks."""
        self.updater.mark_computed(out)


def insert_by_arrival(running: list[SequenceGroup], group: SequenceGroup) -> None:
    """Insert ``group`` into ``running``, which is kept in arrival order."""
    index = len(running)
    while index > 0 and running[index - 1].arrival_time > group.arrival_time:
        index -= 1
    running.insert(index, group)
