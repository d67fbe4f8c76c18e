"""What the engine hands back for each request, named as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class Logprob:
    """One token's log-probability at one position, as vLLM reports it."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    """One completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort", None while running
    stop_reason: Union[str, int, None] = None  # the stop string or stop token id that matched


@dataclass
class RequestOutput:
    """A request's state after a step: its prompt and its completions so far."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
