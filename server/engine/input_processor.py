"""Requests in: prompts to token ids, and every check a request must pass before it is queued.

This is the one place a request is validated against the loaded model and the engine's
limits; the HTTP layer relies on it and only renames the :class:`ConfigError` fields to
its own parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.server.config import ConfigError
from pagedllm.server.pooling_params import PoolingParams
from pagedllm.server.sampling_params import SamplingParams

PromptType = str | dict | list
"""A string, token ids, or a dict: ``{"prompt": str}`` or ``{"prompt_token_ids": [...], "prompt": optional
text}``, either with an optional ``"cache_salt": str`` (prefix-cache blocks are shared only within a salt)."""
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512


@dataclass(frozen=True)
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None


def check_token_ids(ids: Sequence[Any], field: str, vocab_size: int) -> None:
    """Raise :class:`ConfigError` naming ``field`` unless every id is an integer in the vocabulary."""
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(
            field,
            bad[:3],
            f"ids must be integers in [0, {vocab_size})",
            problem="",
            subject=f"{{name}} contain {bad[:3]}",
        )


class InputProcessor:
    """Turns a prompt into token ids and checks the request can run on this engine."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, max_num_seqs: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs

    def process(self, prompt: PromptType, params: SamplingParams | PoolingParams) -> ProcessedPrompt:
        """The prompt's text and token ids; raises :class:`ConfigError` if the request cannot run.

        An embedding request (``PoolingParams``) generates nothing, so its prompt may fill ``max_model_len``.
        """
        processed = self.encode(prompt)
        generates = isinstance(params, SamplingParams)
        self.check_prompt(processed.token_ids, room_to_generate=generates)
        if isinstance(params, SamplingParams):
            self.check_params(params)
        else:
            self.check_pooling(params)
        return processed

    def encode(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            salt = prompt["cache_salt"]
            if not isinstance(salt, str) or not salt:
                raise ConfigError("cache_salt", salt, "a non-empty string", problem="is invalid")
            rest = {k: v for k, v in prompt.items() if k != "cache_salt"}
            return dataclasses.replace(self.encode(rest), cache_salt=salt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return ProcessedPrompt(prompt.get("prompt"), list(prompt["prompt_token_ids"]))
        if isinstance(prompt, dict) and "prompt" in prompt:
            prompt = prompt["prompt"]
        if isinstance(prompt, list):
            return ProcessedPrompt(None, list(prompt))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(
                    "prompt",
                    prompt,
                    "pass prompt_token_ids",
                    problem="is a string but skip_tokenizer_init=True",
                    subject="{name}",
                )
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt))
        raise ConfigError("prompt", prompt, "pass a string or {'prompt_token_ids': [...]}", problem="is invalid")

    def check_prompt(self, token_ids: list[int], room_to_generate: bool = True) -> None:
        if not token_ids:
            raise ConfigError(
                "prompt", token_ids, "at least one token is required", problem="is empty", subject="{name}"
            )
        check_token_ids(token_ids, "prompt_token_ids", self.vocab_size)
        n, limit = len(token_ids), self.max_model_len
        longest = limit - 1 if room_to_generate else limit
        if n > longest:
            problem = (
                f"is longer than max_model_len={limit}"
                if n > limit
                else f"leaves no room to generate within max_model_len={limit}"
            )
            raise ConfigError(
                "prompt", n, f"at most {longest} tokens", problem=problem, subject=f"{{name}} of {n} tokens"
            )

    @staticmethod
    def check_pooling(params: PoolingParams) -> None:
        # NOTE: truncating an embedding is only meaningful for a model trained for it (matryoshka);
        # the models here are not, so, as vLLM, every value is refused rather than silently cut.
        if params.dimensions is not None:
            raise ConfigError(
                "dimensions",
                params.dimensions,
                "leave it unset: embeddings have the model's hidden size",
                problem="is not supported: this model was not trained for matryoshka (truncated) embeddings",
            )

    def check_params(self, params: SamplingParams) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise ConfigError(name, value, f"at most {MAX_LOGPROBS}", problem="is too large")
        check_token_ids(params.stop_token_ids, "stop_token_ids", self.vocab_size)
        check_token_ids(list(params.logit_bias or {}), "logit_bias", self.vocab_size)
        # NOTE: every new token is searched for every stop string: bound the work one request can ask for.
        if len(params.stop_list) > MAX_STOP_STRINGS:
            raise ConfigError(
                "stop",
                f"{len(params.stop_list)} strings",
                f"at most {MAX_STOP_STRINGS}",
                problem="has too many strings",
                subject=f"{{name}} of {len(params.stop_list)} strings",
            )
        if len(params.stop_token_ids) > MAX_STOP_STRINGS:
            raise ConfigError(
                "stop_token_ids",
                len(params.stop_token_ids),
                f"at most {MAX_STOP_STRINGS}",
                problem="has too many ids",
                subject=f"{{name}} of {len(params.stop_token_ids)} ids",
            )
        longest = max(params.stop_list, key=len, default="")
        if len(longest) > MAX_STOP_STRING_CHARS:
            raise ConfigError(
                "stop",
                f"{longest[:20]}...",
                f"at most {MAX_STOP_STRING_CHARS} characters",
                problem="is too long",
                subject=f"{{name}} string of {len(longest)} characters",
            )
        if params.best_of > self.max_num_seqs:
            raise ConfigError(
                "best_of",
                params.best_of,
                "so the request could never run",
                problem=f"is larger than max_num_seqs={self.max_num_seqs}",
            )
        if params.best_of > 1 and params.greedy and not params.use_beam_search:
            raise ConfigError("best_of", params.best_of, "set temperature > 0", problem="needs random sampling")
