"""Scheduling one step ahead (``async_scheduling``): step N+1 is planned while step N runs.

A decode in step N samples a token the host does not know yet. To plan step N+1 the
scheduler counts step N's chunks as computed and gives each sequence that samples in N a
placeholder for that token, so step N+1 computes it like any other uncomputed token::

    step N in flight:  seq 7  tokens [.. t9]         computed 9    (N computes t9, samples t10)
    schedule ahead:    seq 7  tokens [.. t9 <ph>]    computed 10   (N+1 computes <ph>, samples t11)
    step N processed:  seq 7  tokens [.. t9 t10]     <ph> dropped, the sampled t10 appended

The workers get the placeholder as :data:`PLACEHOLDER_TOKEN_ID` and fill it in from the ids
they sampled in step N, on their device. Step N's outputs are processed after step N+1 was
launched: a request that finishes in step N gets no output from step N+1 (the engine drops
its rows) and its blocks are freed when step N is processed, as without lookahead.

Only simple steps are followed ahead (:func:`can_follow`); otherwise the engine processes
step N first and schedules step N+1 as usual. Lookahead never preempts: when the cache may
not hold every running sequence's next token, the engine does not schedule ahead either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.server.core.scheduler_output import PLACEHOLDER_TOKEN_ID
from pagedllm.server.core.sequence import Sequence, SequenceGroup

if TYPE_CHECKING:
    from pagedllm.server.core.scheduler import ScheduledStep, Scheduler


def follows(group: SequenceGroup) -> bool:
    """Whether a request's next step may be planned before its current step's token is known.

    NOTE: every row of such a request samples one token whose sampling parameters do not
    depend on the tokens before it, and no other sequence shares its generator or blocks:
    one sequence, no beams, no penalties, no grammar, no prompt logprobs, ``min_tokens``
    already met, not an embedding.
    """
    params = group.sampling_params
    if group.pooling_params is not None or len(group.seqs) != 1 or group.hypotheses:
        return False
    seq = group.seqs[0]
    return (
        params.n == 1
        and params.best_of == 1
        and not params.use_beam_search
        and params.guided_decoding is None
        and params.prompt_logprobs is None
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and len(seq.output_token_ids) >= params.min_tokens
        and not seq.spec_token_ids
    )


def can_follow(step: ScheduledStep) -> bool:
    """Whether the step after ``step`` may be scheduled while ``step`` runs (:func:`follows`
    for each of its requests; finished ones do not count)."""
    return all(follows(item.group) for item in step.scheduled if not item.group.is_finished())


def surely_ends(group: SequenceGroup, seq: Sequence, max_model_len: int) -> bool:
    """Whether the token ``seq`` samples now ends it whatever it is (``max_tokens``, the model's length)."""
    max_tokens = group.sampling_params.max_tokens
    return (max_tokens is not None and len(seq.output_token_ids) + 1 >= max_tokens) or len(seq) + 1 >= max_model_len


def schedule_ahead(
    scheduler: Scheduler, samplers: list[tuple[SequenceGroup, Sequence]], max_model_len: int
) -> tuple[ScheduledStep | None, list[Sequence]]:
    """The next step, planned with a placeholder for each token of ``samplers`` (the sequences that
    sample in the step in flight, already counted computed by ``SequenceUpdater.advance``), and
    the sequences given one.

    None (and no placeholders left) when the cache might not hold every running sequence's
    next tokens: the engine processes the step in flight first, then schedules as usual.
    """
    held = [seq for group, seq in samplers if not group.is_finished() and not surely_ends(group, seq, max_model_len)]
    scheduler.updater.add_placeholders(held, PLACEHOLDER_TOKEN_ID)
    bm = scheduler.block_manager
    running = [seq for group in scheduler.running for seq in group.running_seqs()]
    if bm.blocks_to_append(running) > bm.num_available:
        scheduler.updater.drop_placeholders(held)
        return None, []
    out = scheduler.schedule()
    assert not out.preempted, "lookahead checked there is room for every running sequence"
    return out, held
