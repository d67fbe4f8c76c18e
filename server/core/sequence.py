"""Sequences and sequence groups: the engine's record of every request in flight."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedllm.server.lora_request import LoRARequest
from pagedllm.server.outputs import Logprob
from pagedllm.server.pooling_params import PoolingParams
from pagedllm.server.sampling_params import SamplingParams

StopReason = str | int | None
"""The stop string or stop token id that ended a sequence (None: EOS, length or still running)."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in FINISHED


FINISHED = (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED)
"""The statuses a sequence ends in (a tuple: membership by identity, the cheapest test on hot paths)."""


Logprobs = dict[int, Logprob]
"""Token id -> its log-probability (and rank), for one position."""


@dataclass(eq=False)  # NOTE: identity semantics; queues find and remove by object
class Sequence:
    """One token stream: the prompt plus what was generated so far.

    NOTE: ``num_computed_tokens`` counts tokens whose K/V are in the cache. A step
    computes ``token_ids[num_computed_tokens : num_computed_tokens + chunk]``; the
    sequence samples only when that reaches ``len(token_ids)``.
    """

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    cumulative_logprob: float | None = 0.0
    """Sum of the sampled tokens' logprobs; None once a token came without one (greedy, no logprobs asked)."""
    output_logprobs: list[Logprobs] = field(default_factory=list)
    output_text: str = ""
    stop_reason: StopReason = None
    cache_salt: str | None = None
    """Prefix-cache blocks are shared only between sequences with the same salt (one per tenant)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Proposed next tokens the coming step verifies (speculative decoding); empty otherwise.

    NOTE: never part of ``token_ids``: they hold cache slots only for the step that checks
    them, and only the accepted ones are appended (and ever counted as computed or hashed)."""
    lora_int_id: int = 0
    """The LoRA adapter it runs with (0: the base model); prefix-cache blocks are shared only within one."""
    # Incremental detokenization offsets into ``token_ids``.
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        # NOTE: prompt + output kept as one list, appended to in place: the hot paths
        # (hashing, input preparation, detokenization) read it every step.
        self._token_ids = self.prompt_token_ids + self.output_token_ids
        self.read_offset = len(self.prompt_token_ids)
        self.prefix_offset = max(self.read_offset - 5, 0)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output tokens. Read-only: change it through :meth:`append_token`."""
        return self._token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    def __len__(self) -> int:
        return len(self._token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_slot_tokens(self) -> int:
        """Positions that need cache slots: the tokens plus the proposals being verified."""
        return len(self._token_ids) + len(self.spec_token_ids)

    @property
    def is_prefill(self) -> bool:
        """More than the newest token is still to be computed."""
        return self.num_tokens - self.num_computed_tokens > 1

    def append_token(self, token_id: int, logprob: float | None, logprobs: Logprobs | None) -> None:
        self.output_token_ids.append(token_id)
        self._token_ids.append(token_id)
        if logprob is None or self.cumulative_logprob is None:
            self.cumulative_logprob = None
        else:
            self.cumulative_logprob += logprob
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    @property
    def has_placeholder(self) -> bool:
        """Whether the last token is a placeholder for one the step in flight samples (``async_scheduling``)."""
        return len(self._token_ids) > len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_placeholder(self, token_id: int) -> None:
        """Stand ``token_id`` in for the token the step in flight samples, so the next step can compute it.

        NOTE: part of ``token_ids`` only, never of ``output_token_ids``; dropped before that step's
        real token is appended (:meth:`drop_placeholder`).
        """
        assert not self.has_placeholder, "one token ahead at most"
        self._token_ids.append(token_id)

    def drop_placeholder(self) -> None:
        if self.has_placeholder:
            self._token_ids.pop()

    @property
    def ranking_logprob(self) -> float:
        """``cumulative_logprob`` of a sequence ranked against others (beams, ``best_of > n``).

        NOTE: such sequences are always sampled with their logprobs, so it is never None.
        """
        assert self.cumulative_logprob is not None, "a ranked sequence carries its logprobs"
        return self.cumulative_logprob

    def reset_for_recompute(self) -> None:
        """Preempted by recomputation: the KV cache is dropped, all tokens are recomputed."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.spec_token_ids = []

    def fork(self, seq_id: int) -> Sequence:
        child = Sequence(
            seq_id,
            self.prompt_token_ids,
            list(self.output_token_ids),
            self.status,
            self.num_computed_tokens,
            self.cumulative_logprob,
            list(self.output_logprobs),
            self.output_text,
            self.stop_reason,
            self.cache_salt,
            lora_int_id=self.lora_int_id,
        )
        child.prefix_offset, child.read_offset = self.prefix_offset, self.read_offset
        return child


@dataclass(eq=False)
class SequenceGroup:
    """One request: its sequences (one at first; forks for n > 1 and beams) and parameters."""

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    prompt_logprobs: list[Logprobs | None] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache when the request was first admitted; None before.

    NOTE: set once, as vLLM does: a request preempted by recomputation and admitted again may
    find its own blocks in the cache, which the client did not save by its prompt."""

    pooling_params: PoolingParams | None = None
    """Set for an embedding request: it runs its prompt, is pooled, and never samples."""

    lora_request: LoRARequest | None = None
    """The LoRA adapter the request runs with; None: the base model."""

    hypotheses: list[Sequence] = field(default_factory=list)
    """Beam search's finished hypotheses so far, best first: block-less copies kept only as outputs."""

    @property
    def reads_every_prompt_position(self) -> bool:
        """Prompt logprobs and mean pooling need every prompt position computed (none taken from the cache)."""
        pooling = self.pooling_params
        return self.sampling_params.prompt_logprobs is not None or (
            pooling is not None and pooling.reads_every_position
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status is status]

    def running_seqs(self) -> list[Sequence]:
        """``get_seqs(RUNNING)``, without the copy for the usual single sequence: do not modify it."""
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs if seqs[0].status is SequenceStatus.RUNNING else []
        return [s for s in seqs if s.status is SequenceStatus.RUNNING]

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status not in FINISHED]

    def is_finished(self) -> bool:
        for s in self.seqs:
            if s.status not in FINISHED:
                return False
        return True

    @property
    def max_num_running_seqs(self) -> int:
        """Sequences this group will run at its widest (for ``max_num_seqs``)."""
        params = self.sampling_params
        if not self.seqs or self.seqs[0].num_computed_tokens == 0 and not self.seqs[0].output_token_ids:
            return params.best_of
        return len(self.unfinished_seqs())

    @property
    def is_multi_seq(self) -> bool:
        return self.sampling_params.best_of > 1
