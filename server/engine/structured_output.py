"""Structured outputs: grammars (JSON schema, regex, choice, EBNF) turned into per-step token masks.

Built on xgrammar. A request's grammar is compiled once when it is added (xgrammar keeps
compiled grammars in its own cache, so a schema sent again compiles instantly); each of
its sequences gets a matcher that follows the tokens it accepts. Every step the masks of
all constrained rows are filled into one packed bitmask on the host and sent with the step
to the worker's sampler, which applies it on the device after the raw log-probabilities are
taken (so reported logprobs stay the model's).

A grammar given with a reasoning model's markers constrains only the answer after the
reasoning (:mod:`~pagedllm.server.engine.reasoning_gate`): those rows are left unmasked while
the model thinks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.server.config import ConfigError
from pagedllm.server.engine.reasoning_gate import MarkerTokens, ReasoningGate, marker_tokens
from pagedllm.server.sampling_params import GuidedDecodingParams

FIELDS = {
    "json": "guided_json",
    "json_object": "response_format",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
}


@dataclass(frozen=True)
class Grammar:
    """A request's compiled grammar and, for a reasoning model, where its answer begins."""

    compiled: Any
    """xgrammar's compiled grammar."""
    markers: MarkerTokens | None = None
    """The reasoning markers (None: the grammar applies from the first token)."""


class StructuredOutputs:
    """Compiles grammars for one tokenizer and makes the token masks of a step."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._compiler: Any = None

    def _xgrammar(self) -> Any:
        try:
            import xgrammar
        except ImportError as exc:  # pragma: no cover (a dependency; reported clearly if it is missing)
            raise ConfigError("guided_decoding", "requested", "install xgrammar", problem="needs xgrammar") from exc
        if self._compiler is None:
            if self.tokenizer is None:
                raise ConfigError(
                    "guided_decoding",
                    "requested",
                    "start the server with a tokenizer",
                    problem="needs a tokenizer (--skip-tokenizer-init is set)",
                )
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids) or None
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return xgrammar

    def compile(self, guided: GuidedDecodingParams) -> Grammar:
        """The compiled grammar; a schema, regex or grammar xgrammar refuses raises :class:`ConfigError`."""
        reasoning = guided.reasoning
        markers = marker_tokens(reasoning, self.tokenizer) if reasoning and reasoning.opening != "answer" else None
        return Grammar(self._compile(guided), markers)

    def _compile(self, guided: GuidedDecodingParams) -> Any:
        self._xgrammar()
        compiler = self._compiler
        kind = guided.kind
        try:
            if kind == "json_object":  # NOTE: OpenAI's json_object is an object, not any JSON value
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "json":
                schema = guided.json if isinstance(guided.json, str) else json.dumps(guided.json)
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(guided.regex)
            if kind == "choice":
                return compiler.compile_regex("|".join(f"({re.escape(c)})" for c in guided.choice or []))
            return compiler.compile_grammar(guided.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            value = getattr(guided, kind)
            shown = value if isinstance(value, (str, dict, list)) else kind
            raise ConfigError(
                FIELDS[kind], shown, f"a valid {kind.replace('_', ' ')}: {exc}".strip(), problem="cannot be compiled"
            ) from exc

    def matcher(self, grammar: Grammar) -> Any:
        """A matcher following one sequence (a :class:`ReasoningGate` around it for a reasoning model)."""
        matcher = self._xgrammar().GrammarMatcher(grammar.compiled)
        return matcher if grammar.markers is None else ReasoningGate(matcher, grammar.markers, self.tokenizer)

    def masks(self, matchers: list[Any]) -> list[np.ndarray | None]:
        """Per matcher, ceil(vocab_size / 32) int32: the tokens it allows next, packed (bit j of word
        w: token 32 w + j); None where any token is (a reasoning model thinking)."""
        xgrammar = self._xgrammar()
        bitmask = xgrammar.allocate_token_bitmask(len(matchers), self.vocab_size)
        masked = []
        for row, matcher in enumerate(matchers):
            filled = matcher.fill_next_token_bitmask(bitmask, row)
            masked.append(not isinstance(matcher, ReasoningGate) or filled)
        words = bitmask.numpy()
        return [words[row] if keep else None for row, keep in enumerate(masked)]
