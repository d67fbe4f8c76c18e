"""Speculative decoding (vLLM's ``--speculative-config``): n-gram prompt lookup or a draft model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.server.config.checks import ConfigError, check_choice, check_range, json_object

SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, given as vLLM's ``--speculative-config`` JSON.

    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}``
    proposes the tokens that followed the latest earlier occurrence of the sequence's last
    n tokens (prompt lookup); the model verifies them all in one step.
    ``{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}`` proposes a
    smaller model's greedy tokens; it shares the target's tokenizer and keeps its own KV
    cache in the target's block ids.
    """

    method: str = "ngram"
    """How proposals are made: ``ngram`` (prompt lookup) or ``draft_model``."""
    num_speculative_tokens: int = 4
    """Tokens proposed per step (at most 16)."""
    prompt_lookup_max: int | None = None
    """Longest n-gram matched (ngram); default: prompt_lookup_min, or 5."""
    prompt_lookup_min: int | None = None
    """Shortest n-gram matched (ngram); default: prompt_lookup_max, or 5."""
    model: str | None = None
    """The draft model's directory (draft_model only): a checkpoint with the target's vocabulary."""

    def __post_init__(self) -> None:
        check_choice("speculative_config.method", self.method, SPEC_METHODS)
        if self.method == "draft_model" and not self.model:
            raise ConfigError(
                "speculative_config.model",
                self.model,
                "give the draft model's directory",
                problem="is required with method draft_model",
            )
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError(
                "speculative_config.model", self.model, "use method draft_model", problem="is only for draft_model"
            )
        name = "speculative_config.num_speculative_tokens"
        check_range(name, self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low, high = (high if low is None else low), (low if high is None else high)
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        check_range("speculative_config.prompt_lookup_min", low, 1)
        check_range("speculative_config.prompt_lookup_max", high, low)

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From the JSON text of the flag, a dict of its keys, or an instance; errors name the key at fault."""
        if isinstance(value, SpeculativeConfig):
            return value
        return cls(**json_object("speculative_config", value, cls))
