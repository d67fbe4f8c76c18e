"""One step's budget: how many tokens it computes and how many sequences it runs.

The scheduler spends it group by group; each sequence of a group gets a chunk of the
tokens left (its whole uncomputed rest, or with chunked prefill a part of a long prompt).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from pagedllm.server.config import SchedulerConfig
from pagedllm.server.core.sequence import Sequence, SequenceGroup


@dataclass
class StepBudget:
    max_tokens: int
    max_seqs: int
    tokens: int = 0
    seqs: int = 0

    @classmethod
    def for_step(
        cls,
        config: SchedulerConfig,
        token_budget: int,
        running: list[SequenceGroup],
        waiting: Collection,
        held: list[SequenceGroup],
    ) -> StepBudget:
        """This step's budget: the whole token budget, or, while more sequences decode than
        prompts wait, their tokens plus at most ``max_prefill_tokens_while_decoding`` prompt tokens.
        Streams ``held`` while a burst of prompts is admitted (:mod:`~pagedllm.server.core.prompt_burst`)
        keep their seats, and the burst's rest, however many prompts, has the whole token budget.

        NOTE: a step's prompt tokens are what every decoding stream waits for before its next
        token. A few streams are stalled once rather than many prompts trickling in over many
        steps, each of which would stall every stream again.
        """
        if held:
            return cls(token_budget, config.max_num_seqs, seqs=sum(len(g.running_seqs()) for g in held))
        return cls(_step_tokens(config, token_budget, running, waiting), config.max_num_seqs)

    @property
    def tokens_left(self) -> int:
        return self.max_tokens - self.tokens

    def chunks(self, seqs: list[Sequence], chunked_prefill: bool) -> dict[int, int] | None:
        """Tokens each sequence computes this step; None if one cannot make progress."""
        # NOTE: sequences of one group share the budget equally, so beams of equal length
        # (all recomputed from scratch) finish their prefill in the same step.
        share = self.tokens_left // len(seqs)
        chunks = {}
        for seq in seqs:
            uncomputed = seq.num_tokens - seq.num_computed_tokens
            chunk = uncomputed if uncomputed <= share else share
            if chunk <= 0 or (chunk < uncomputed and not chunked_prefill):
                return None
            chunks[seq.seq_id] = chunk
        return chunks


def _step_tokens(config: SchedulerConfig, token_budget: int, running: list[SequenceGroup], waiting: Collection) -> int:
    cap = config.max_prefill_tokens_while_decoding
    if cap is None:
        return token_budget
    # NOTE: only the waiting prompts that have a free seat could join this step
    seats = max(config.max_num_seqs - len(running), 0)
    decode_tokens, decoding, prompts = 0, 0, min(len(waiting), seats)
    for group in running:
        seqs = group.running_seqs()
        if any_prefill(seqs):
            prompts += 1
        else:
            decoding += 1
            decode_tokens += sum(1 + len(seq.spec_token_ids) for seq in seqs)
    if decoding <= prompts:
        return token_budget
    return min(token_budget, decode_tokens + cap)


def any_prefill(seqs: list[Sequence]) -> bool:
    """Whether one of ``seqs`` has more than one token to compute (a prompt, or a recomputed sequence)."""
    for s in seqs:
        if s.num_tokens - s.num_computed_tokens > 1:  # NOTE: Sequence.is_prefill, inlined: runs per sequence per step
            return True
    return False
