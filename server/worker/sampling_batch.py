"""What a step asks the worker's sampler to do, and what comes back: plain, typed, small.

The engine describes each logits row (:class:`RowSampling`), each sequence verifying
proposals (:class:`SpecVerify`) and each row scoring its prompt (:class:`PromptScoring`)
in a :class:`SamplingBatch` that travels in the step message; the worker answers with a
:class:`SamplerOutput` of token ids and only the log-probabilities a request asked for.

NOTE: nothing here holds a tensor or a live engine object (plain Python and numpy only),
so a batch pickles to the other ranks by value and the engine builds it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class RowSampling:
    """How one row of the step's logits becomes tokens (or beam candidates).

    NOTE: frozen, so the engine may send one object again while it still describes the row;
    compared by identity (its numpy fields have no single truth value)."""

    request_id: str
    """The request the row belongs to: names its seeded generator and its failures."""
    temperature: float = 0.0
    """0: greedy (argmax)."""
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    """The request's seed: its generator is made from it on first use (None: the worker's own)."""
    num_samples: int = 1
    """Tokens drawn from the row (``best_of`` at a group's first token, else 1)."""
    needs_logprobs: bool = False
    """Whether the drawn tokens' log-probabilities are reported (or rank samples)."""
    num_logprobs: int | None = None
    """Top log-probabilities reported per token (None: none; 0: the token's own only)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, value) added to the logits."""
    banned_token_ids: tuple[int, ...] = ()
    """Tokens that cannot be chosen yet (EOS and stop ids before ``min_tokens``)."""
    prompt_token_ids: np.ndarray | None = None
    """[prompt] int64, for the repetition penalty (None when the row has no penalty)."""
    output_token_ids: np.ndarray | None = None
    """[output] int64, for the penalties (None when the row has no penalty).

    NOTE: the whole sequence travels each step for a penalized row (O(length) bytes and
    work per step), which keeps the worker free of per-sequence state; rows without
    penalties send nothing."""
    allowed: np.ndarray | None = None
    """[ceil(vocab / 32)] int32 packed bitmask of the tokens a grammar allows (None: all)."""
    num_beam_candidates: int = 0
    """> 0: a beam row; the worker returns its best candidates instead of drawing."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty or self.frequency_penalty)

    @property
    def processed(self) -> bool:
        """Whether any logits processor changes the row."""
        return self.penalized or bool(self.logit_bias or self.banned_token_ids) or self.allowed is not None


@dataclass(frozen=True)
class SpecVerify:
    """A sequence verifying proposals: rows ``first_row .. first_row + len(draft_token_ids)``."""

    first_row: int
    draft_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class PromptScoring:
    """A chunk scoring its prompt: one prompt-logits row per token in ``token_ids``."""

    request_id: str
    token_ids: tuple[int, ...]
    """The prompt tokens whose log-probabilities the rows give, in order."""
    num_logprobs: int


@dataclass
class SamplingBatch:
    """One step's sampling work, aligned with the step's logits rows."""

    rows: list[RowSampling]
    """One per logits row: the sample rows, then each verifying sequence's rows."""
    num_sample_rows: int
    """How many of ``rows`` are sample or beam rows; the rest belong to ``verify``."""
    verify: list[SpecVerify] = field(default_factory=list)
    prompts: list[PromptScoring] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that finished or were aborted since the last step: their generators go."""


@dataclass
class Tokens:
    """Tokens of one row (or a verified sequence, or a prompt chunk) and the log-probabilities asked for."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    """Each token's log-probability under the model (``log_softmax`` of raw logits); None: not needed."""
    ranks: list[int] | None = None
    """Each token's rank among the vocabulary (1: the likeliest), with ``top``."""
    top: list[list[tuple[int, float]]] | None = None
    """Per token, the ``num_logprobs`` likeliest (token id, log-probability) at its position, best first."""


@dataclass
class SamplerOutput:
    """What the worker returns for a step's sampling: no logits."""

    rows: list[Tokens | None]
    """Per sample row: its drawn tokens, or a beam row's candidates; None where it failed."""
    verified: list[Tokens | None] = field(default_factory=list)
    """Per :class:`SpecVerify`: the emitted tokens (accepted proposals and one more)."""
    prompts: list[Tokens | None] = field(default_factory=list)
    """Per :class:`PromptScoring`: its prompt tokens' log-probabilities."""
    errors: dict[str, str] = field(default_factory=dict)
    """request id -> why its sampling failed (the others' results stand)."""
