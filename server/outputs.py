"""What the engine hands back for each request, named as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability at one position, as vLLM reports it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort", None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched


@dataclass
class RequestOutput:
    """A request's state after a step: its prompt and its completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    """Why the request failed inside the engine (it is then finished); None when it did not."""
    num_cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache (whole blocks); None until the request is scheduled."""


@dataclass
class EmbeddingOutput:
    """One prompt's embedding, as vLLM's ``EmbeddingOutput``."""

    embedding: list[float] = field(default_factory=list)
    """The pooled final hidden state (empty until the request finishes)."""


@dataclass
class EmbeddingRequestOutput:
    """An embedding request's state after a step, as vLLM's ``EmbeddingRequestOutput``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput = field(default_factory=EmbeddingOutput)
    finished: bool = False
    error: str | None = None
    """Why the request failed inside the engine (it is then finished); None when it did not."""


EngineOutput = RequestOutput | EmbeddingRequestOutput
"""What one engine step reports for a request: a generation's or an embedding's state."""
