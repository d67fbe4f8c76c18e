"""Beam search decisions, with Hugging Face's scoring and stopping rules.

One call per step and group: given each running beam's best candidates (the worker's
``max(2, 1 + #eos) * k`` likeliest tokens and their log-probabilities: the only ones that
can rank among the best pairs overall), pick the next beams and the hypotheses that
finish. The scheduler then forks and drops sequences as decided (the paper's Fig. 9:
beams share blocks, and a dropped beam's blocks lose a reference).

Per step, as in ``transformers``' beam search:

- candidates are the ``max(2, 1 + #eos) * k`` best (beam, token) pairs by cumulative
  log-probability;
- a candidate that ends (EOS, or the length limit) and ranks among the first ``k``
  becomes a hypothesis scored ``sum_logprobs / generated_len ** length_penalty``;
- the ``k`` best candidates that do not end are the next beams;
- the search stops when every candidate ends, when ``early_stopping=True`` and ``k``
  hypotheses exist, or when no running beam can beat the worst of ``k`` hypotheses
  (estimated at the current length, or at the maximum length for ``"never"`` with a
  positive length penalty).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from pagedllm.server.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.server.core.sequence_updates import GroupUpdate, NewSeq, SeqUpdate
from pagedllm.server.engine.output_processor import OutputProcessor
from pagedllm.server.sampling_params import SamplingParams
from pagedllm.server.worker.sampling_batch import Tokens


@dataclass
class Candidate:
    parent: Sequence
    token: int
    logprob: float  # of the token alone
    score: float  # cumulative log-probability including the token


@dataclass
class BeamState:
    """What a beam group remembers between steps."""

    scored: list[tuple[float, int]] = field(default_factory=list)
    """(score, seq id) of the finished hypotheses kept, best first (the group holds the sequences)."""
    improvable: bool = True


@dataclass
class BeamStep:
    running: list[Candidate]  # the next beams, best first
    finished: list[Candidate]  # candidates that became hypotheses this step
    done: bool


def beam_step(
    state: BeamState,
    beams: list[Sequence],
    best: list[Tokens],
    params: SamplingParams,
    eos_token_ids: tuple[int, ...],
    at_length_limit: bool,
) -> BeamStep:
    """Decide one step. ``best[i]``: the likeliest tokens of ``beams[i]`` and their log-probabilities
    (``log_softmax`` of the beam's logits), best first.

    ``at_length_limit`` says the new token is the last one allowed (max_tokens or max_model_len).
    """
    width = params.best_of
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    gen_len = len(beams[0].output_token_ids) + 1
    candidates = _ranked(beams, best, max(2, 1 + len(eos)) * width)
    ends = [at_length_limit or c.token in eos for c in candidates]
    running = [c for c, end in zip(candidates, ends) if not end][:width]
    full = len(state.scored) >= width and params.early_stopping is True
    finished = []
    if state.improvable and not full:
        finished = [c for c, end in zip(candidates[:width], ends[:width]) if end]
    new_scores = [c.score / gen_len**params.length_penalty for c in finished]
    _update_improvable(state, running, new_scores, gen_len, params)
    done = (
        all(ends)
        or not state.improvable
        or (len(state.scored) + len(finished) >= width and params.early_stopping is True)
    )
    return BeamStep(running, finished, done)


def _ranked(beams: list[Sequence], best: list[Tokens], keep: int) -> list[Candidate]:
    """The ``keep`` best (beam, token) pairs by cumulative log-probability, best first."""
    pool = []
    for b, (beam, tokens) in enumerate(zip(beams, best)):
        assert tokens.logprobs is not None
        cumulative = np.float32(beam.cumulative_logprob)
        for r, (token, logprob) in enumerate(zip(tokens.token_ids, tokens.logprobs)):
            # NOTE: scored in float32, as the model's log-probabilities are
            pool.append((-float(np.float32(logprob) + cumulative), b, r, token, logprob))
    return [Candidate(beams[b], token, logprob, -score) for score, b, _, token, logprob in sorted(pool)[:keep]]


def _update_improvable(
    state: BeamState, running: list[Candidate], new_scores: list[float], gen_len: int, params: SamplingParams
) -> None:
    scores = sorted([s for s, _ in state.scored] + new_scores, reverse=True)[: params.best_of]
    if len(scores) < params.best_of or not running:
        return
    if params.early_stopping == "never" and params.length_penalty > 0 and params.max_tokens is not None:
        best_len = params.max_tokens
    else:
        best_len = gen_len
    best_possible = running[0].score / best_len**params.length_penalty
    state.improvable = state.improvable and best_possible > min(scores)


def add_hypotheses(state: BeamState, new: list[tuple[float, int]], width: int) -> None:
    """Keep the ``width`` best-scoring hypotheses (earlier ones win ties, as in a stable top-k)."""
    merged = state.scored + new
    order = sorted(range(len(merged)), key=lambda i: (-merged[i][0], i))
    state.scored = [merged[i] for i in order[:width]]


class BeamSearch:
    """Turns :func:`beam_step`'s choices into a :class:`GroupUpdate` for the scheduler to apply.

    Kept beams fork (children share their parent's blocks), dropped beams are released
    (their blocks lose a reference), and finished candidates become hypotheses: block-less
    copies that exist only as outputs. Sequences are read here, never changed.
    """

    def __init__(self, outputs: OutputProcessor, new_seq_id: Callable[[], int]) -> None:
        self.outputs = outputs
        self.new_seq_id = new_seq_id

    def decide(
        self, group: SequenceGroup, state: BeamState, beams: list[Sequence], candidates: list[Tokens]
    ) -> GroupUpdate:
        """Advance ``group`` by one token; ``candidates[i]``: the worker's best tokens for ``beams[i]``."""
        params = group.sampling_params
        gen_len = len(beams[0].output_token_ids) + 1
        at_limit = (params.max_tokens is not None and gen_len >= params.max_tokens) or len(
            beams[0]
        ) + 1 >= self.outputs.max_model_len
        decided = beam_step(state, beams, candidates, params, self.outputs.eos_token_ids, at_limit)
        hyps, hyp_updates, scored = [], [], []
        for cand in decided.finished:
            seq_id = self.new_seq_id()
            hyps.append(NewSeq(cand.parent.seq_id, seq_id, shares_blocks=False))
            stopped = self.outputs.is_eos(cand.token, params)
            finish = SequenceStatus.FINISHED_STOPPED if stopped else SequenceStatus.FINISHED_LENGTH
            hyp_updates.append(replace(self._next(cand, params), seq_id=seq_id, finish=finish))
            scored.append((cand.score / gen_len**params.length_penalty, seq_id))
        add_hypotheses(state, scored, params.best_of)
        kept = tuple(seq_id for _, seq_id in state.scored)
        if decided.done:
            drops = tuple(beam.seq_id for beam in beams)
            return GroupUpdate(
                group.request_id,
                new_seqs=tuple(hyps),
                updates=tuple(hyp_updates),
                drops=drops,
                hypotheses=kept,
                seqs=kept,
            )
        forks, updates, drops, order = self._fork_beams(beams, decided.running, params)
        return GroupUpdate(
            group.request_id,
            new_seqs=tuple(hyps + forks),
            updates=tuple(hyp_updates + updates),
            drops=drops,
            hypotheses=kept,
            seqs=order,
        )

    def _next(self, cand: Candidate, params: SamplingParams) -> SeqUpdate:
        """The candidate's token appended to its parent (beam search checks its own ends)."""
        return self.outputs.decide(cand.parent, (cand.token,), (cand.logprob,), None, params, check_stops=False)

    def _fork_beams(
        self, beams: list[Sequence], running: list[Candidate], params: SamplingParams
    ) -> tuple[list[NewSeq], list[SeqUpdate], tuple[int, ...], tuple[int, ...]]:
        """Forks, token updates, dropped beams, and the next beams by cumulative logprob, best first."""
        children: dict[int, list[Candidate]] = {}
        for cand in running:
            children.setdefault(cand.parent.seq_id, []).append(cand)
        forks, updates, drops, ranked = [], [], [], []
        for parent in beams:
            cands = children.get(parent.seq_id)
            if not cands:
                drops.append(parent.seq_id)  # a dropped beam: its blocks lose a reference
                continue
            for cand in cands[1:]:
                child_id = self.new_seq_id()
                forks.append(NewSeq(parent.seq_id, child_id))  # NOTE: shares the parent's blocks
                updates.append(replace(self._next(cand, params), seq_id=child_id))
                ranked.append((child_id, parent.ranking_logprob + cand.logprob))
            updates.append(self._next(cands[0], params))
            ranked.append((parent.seq_id, parent.ranking_logprob + cands[0].logprob))
        ranked.sort(key=lambda r: r[1], reverse=True)  # NOTE: stable, as sorting the sequences was
        return forks, updates, tuple(drops), tuple(seq_id for seq_id, _ in ranked)
