"""Prompts that arrive together before anything decodes: prefilled in two steps, decoded together.

On a CPU a step of prompts is compute-bound, so a burst of prompts prefilled in one step
answers every one of them at that step's end. :class:`PromptBurst` splits a large burst that
one step's token budget holds in two: the first step admits the oldest prompts, as many as
come nearest half the burst's tokens (:func:`in_first_half`), and their streams get their
first token then; the next step admits the rest. Streams that have their first token only
(the first half's, and any of the burst prefilled alone a step before it, as often happens
with a few clients) are *held* meanwhile: not scheduled, so the whole burst decodes from
the step after on and finishes together, and no token comes later than with one step but
a stream prefilled before the burst's second (``prompt_burst_split_tokens``,
:data:`~pagedllm.server.config.scheduler.DEFAULT_BURST_SPLIT`).
"""

from __future__ import annotations

from collections.abc import Collection

from pagedllm.server.core.sequence import SequenceGroup
from pagedllm.server.core.step_budget import any_prefill


class PromptBurst:
    def __init__(self, split_tokens: int, max_num_seqs: int) -> None:
        self.split_tokens = split_tokens
        """A burst with more prompt tokens than this is split (0: never)."""
        self.max_num_seqs = max_num_seqs
        self._second_step = False
        """The last step admitted a burst's first half: this one admits the rest."""

    def plan(
        self, running: list[SequenceGroup], waiting: Collection[SequenceGroup], swapped: Collection, token_budget: int
    ) -> tuple[int | None, list[SequenceGroup]]:
        """The prompt tokens of the burst whose first half this step admits (None: no burst starts),
        and the groups it holds (streams with only their first token, while a burst is admitted).

        NOTE: only a burst that one step's ``token_budget`` holds is split: a larger one is spread
        over steps by the budget anyway, and holding streams through all of them would delay
        their next tokens."""
        second_step, self._second_step = self._second_step, False
        if second_step:
            return None, _fresh(running)
        if not self.split_tokens or swapped or any(map(_has_decoded, running)):
            return None, []
        seats = max(self.max_num_seqs - len(running), 0)
        burst = [group for _, group in zip(range(seats), waiting, strict=False)]
        tokens = sum(prompt_tokens(group) for group in burst)
        if len(burst) < 2 or not self.split_tokens < tokens <= token_budget:
            return None, []
        return tokens, _fresh(running)

    def admitted(self, groups: list[SequenceGroup]) -> None:
        """The first step of a split burst admitted ``groups``: the next step admits the rest."""
        self._second_step = bool(groups)


def _has_decoded(group: SequenceGroup) -> bool:
    """Whether a running group has decoded past its first token."""
    return any(len(seq.output_token_ids) > 1 for seq in group.running_seqs())


def _fresh(running: list[SequenceGroup]) -> list[SequenceGroup]:
    """The running groups that have their first token and no other."""
    return [g for g in running if not any_prefill(seqs := g.running_seqs()) and not _has_decoded(g) and seqs]


def in_first_half(admitted: int, prompt: int, burst: int) -> bool:
    """Whether a prompt of ``prompt`` tokens joins the first half of a burst of ``burst`` tokens,
    ``admitted`` of which the first half holds: when its middle is within that half."""
    return 2 * admitted + prompt <= burst


def prompt_tokens(group: SequenceGroup) -> int:
    """The tokens a waiting group's prompt computes."""
    return group.seqs[0].num_uncomputed_tokens  # NOTE: a group's sequences share their prompt
