"""Per-request sampling parameters, named and validated as in vLLM's ``SamplingParams``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedllm.server.config import ConfigError

_GREEDY_EPS = 1e-5
OPENINGS = ("reasoning", "answer", "either")


class RequestOutputKind(enum.IntEnum):
    """Which outputs a request's steps give, as vLLM's ``RequestOutputKind``."""

    CUMULATIVE = 0
    """After every step that advanced it: everything it has so far."""
    DELTA = 1
    """What each step added (not served: refused with a :class:`ConfigError`)."""
    FINAL_ONLY = 2
    """One output, when it ends: the engine builds none for its steps before (what ``LLM.generate`` uses)."""


@dataclass(frozen=True)
class ReasoningMarkers:
    """How a reasoning model marks its reasoning, so that a grammar constrains only the answer after it."""

    starts: tuple[str, ...]
    """Texts that open the reasoning (any one)."""
    ends: tuple[str, ...]
    """Texts that close it; the grammar applies from the token after one of them."""
    opening: str = "either"
    """Where the output begins: ``reasoning`` (the prompt opened the block), ``answer`` (thinking is
    off) or ``either`` (the output's first token tells: an opening text, or the grammar's first token)."""

    def __post_init__(self) -> None:
        if self.opening not in OPENINGS:
            raise ConfigError("reasoning.opening", self.opening, f"one of {list(OPENINGS)}")
        if not self.ends or not all(self.ends):
            raise ConfigError("reasoning.ends", self.ends, "at least one non-empty text")


@dataclass
class GuidedDecodingParams:
    """Constrain the output to a grammar (one of the fields), as vLLM's ``guided_decoding``.

    ``json``: a JSON schema (dict or text); ``json_object``: any JSON object; ``regex``: a
    regular expression; ``choice``: one of these strings; ``grammar``: an EBNF grammar.
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    reasoning: ReasoningMarkers | None = None
    """A reasoning model's markers: the reasoning is free text and the grammar constrains the answer."""

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ConfigError(
                "guided_decoding",
                given,
                "set exactly one of json, json_object, regex, choice, grammar",
                problem="is invalid",
                subject=f"{{name}} with {given or 'nothing'} set",
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ConfigError("guided_choice", self.choice, "a list of non-empty strings", problem="is invalid")

    @property
    def kind(self) -> str:
        # NOTE: "is not None", as __post_init__ counts them: an empty schema is given (and refused by the compiler)
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        return given[0] if given else "json_object"


@dataclass
class SamplingParams:
    """How to decode one request. Invalid values raise :class:`ConfigError` naming field and value."""

    n: int = 1
    """Completions returned for the prompt."""
    # NOTE: None (the default) means n; __post_init__ resolves it, so it is an int after construction.
    best_of: int = None  # type: ignore[assignment]
    """Completions generated (the ``n`` best by cumulative log-probability are returned)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Smallest set of tokens whose probability mass reaches ``top_p``."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens; 0 (or -1) keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the most likely one's."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or output."""
    seed: int | None = None
    """Seed of this request's own random generator, for reproducible sampling."""
    stop: None | str | list[str] = None
    """Strings that end generation; they are not included in the text."""
    # NOTE: None becomes [] in __post_init__.
    stop_token_ids: list[int] = None  # type: ignore[assignment]
    """Token ids that end generation (kept in ``token_ids``)."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's length limit."""
    min_tokens: int = 0
    """Fewest tokens to generate before EOS or stop token ids may end the sequence."""
    logprobs: int | None = None
    """Return this many most likely log-probabilities per generated token (plus the chosen one)."""
    prompt_logprobs: int | None = None
    """Return this many most likely log-probabilities per prompt token."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    use_beam_search: bool = False
    """Beam search with ``best_of`` beams, returning the ``n`` best."""
    length_penalty: float = 1.0
    """Beam search: scores are divided by length ** length_penalty."""
    early_stopping: bool | str = False
    """Beam search stopping rule, as Hugging Face's (True, False or "never")."""
    logit_bias: dict[int, float] | None = None
    """Token id -> a value added to its logit before sampling (-100 bans it, +100 forces it)."""
    guided_decoding: GuidedDecodingParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """Outputs after every step (cumulative) or only the last one (``FINAL_ONLY``)."""

    stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if self.top_k == -1:
            self.top_k = 0
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        checks = [
            ("n", self.n, isinstance(self.n, int) and self.n >= 1, "an integer >= 1"),
            (
                "best_of",
                self.best_of,
                isinstance(self.best_of, int) and self.best_of >= self.n,
                f"an integer >= n ({self.n})",
            ),
            ("temperature", self.temperature, self.temperature >= 0, ">= 0"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0, "0, -1 (all) or a positive integer"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1]"),
            ("presence_penalty", self.presence_penalty, -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", self.frequency_penalty, -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty, 0 < self.repetition_penalty <= 2, "in (0, 2]"),
            (
                "max_tokens",
                self.max_tokens,
                self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                ">= 1 or None",
            ),
            (
                "min_tokens",
                self.min_tokens,
                isinstance(self.min_tokens, int)
                and self.min_tokens >= 0
                and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
                ">= 0 and <= max_tokens",
            ),
            ("logprobs", self.logprobs, self.logprobs is None or self.logprobs >= 0, ">= 0 or None"),
            (
                "prompt_logprobs",
                self.prompt_logprobs,
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                ">= 0 or None",
            ),
            ("stop", self.stop, all(isinstance(s, str) and s for s in self.stop_list), "non-empty strings"),
            ("seed", self.seed, self.seed is None or isinstance(self.seed, int), "an integer or None"),
            (
                "early_stopping",
                self.early_stopping,
                self.early_stopping in (True, False, "never"),
                'True, False or "never"',
            ),
        ]
        kinds = (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)
        checks.append(("output_kind", self.output_kind, self.output_kind in kinds, "CUMULATIVE or FINAL_ONLY"))
        if self.output_kind in kinds:
            self.output_kind = RequestOutputKind(self.output_kind)  # NOTE: an int given is compared by identity later
        for name, value, ok, allowed in checks:
            if not ok:
                raise ConfigError(name, value, f"must be {allowed}", problem="is invalid")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or not -100 <= bias <= 100:
                raise ConfigError(
                    "logit_bias", {token: bias}, "token ids mapped to values in [-100, 100]", problem="is invalid"
                )
        if self.use_beam_search and self.guided_decoding is not None:
            raise ConfigError(
                "guided_decoding",
                self.guided_decoding.kind,
                "use sampling or greedy decoding",
                problem="cannot be combined with beam search",
            )
        if self.use_beam_search and self.temperature > _GREEDY_EPS:
            raise ConfigError("temperature", self.temperature, "must be 0", problem="is invalid with use_beam_search")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
