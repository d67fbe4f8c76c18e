"""Iteration-level scheduling: sequences and tokens per step, preemption, chunked prefill."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagedllm.server.config.checks import ConfigError, check_choice, check_range, field_help
from pagedllm.server.config.model import DEVICES
from pagedllm.server.config.speculative import SpeculativeConfig

PREEMPTION_MODES = (None, "recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=256, metadata=field_help("Most sequences running in one iteration."))
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=field_help(
            "Token budget of one iteration (prompt chunks + decodes); default 4096 on CPU, 2048 on CUDA,"
            " at least max_model_len with chunked prefill off."
        ),
    )
    max_prefill_tokens_while_decoding: int | None = field(
        default=None,
        metadata=field_help(
            "Prompt tokens one iteration computes at most while more sequences decode than prompts wait,"
            " which bounds their inter-token stall; needs chunked prefill (default 256 on CPU, none on CUDA)."
        ),
    )
    prompt_burst_split_tokens: int | None = field(
        default=None,
        metadata=field_help(
            "Prompts that arrive together while nothing decodes, more tokens than this in all (and within the"
            " token budget), are prefilled in two steps: the first half's streams get their first token a step"
            " sooner and wait for the second half, so the burst decodes together; 0 turns it off (default 512"
            " on CPU; off on CUDA and with async scheduling)."
        ),
    )
    preemption_mode: str | None = field(
        default=None,
        metadata=field_help(
            "How to preempt (default: recompute single sequences, swap groups).", choices=PREEMPTION_MODES
        ),
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=field_help("Split long prompts over several iterations, batched with decodes.")
    )
    async_scheduling: bool = field(
        default=False,
        metadata=field_help(
            "Schedule and prepare the next step while the current one runs (decodes are scheduled one token"
            " ahead, the worker fills in the token it sampled); steps that cannot run ahead run in turn."
            " One rank only."
        ),
    )
    speculative_config: SpeculativeConfig | None = field(
        default=None,
        metadata=field_help(
            "Speculative decoding, as vLLM's JSON, e.g. "
            """{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}"""
            " (default: off).",
            flag_type=str,  # NOTE: the text goes to the config, whose errors name the key at fault
        ),
    )

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        check_range("max_num_seqs", self.max_num_seqs, 1)
        check_range("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_range("max_prefill_tokens_while_decoding", self.max_prefill_tokens_while_decoding, 1)
        check_range("prompt_burst_split_tokens", self.prompt_burst_split_tokens, 0)
        if self.max_prefill_tokens_while_decoding is not None and not self.enable_chunked_prefill:
            raise ConfigError(
                "max_prefill_tokens_while_decoding",
                self.max_prefill_tokens_while_decoding,
                "unset when enable_chunked_prefill is off (a prompt could not be split to fit it)",
                problem="is not allowed",
            )
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if self.prompt_burst_split_tokens and self.async_scheduling:
            raise ConfigError(
                "prompt_burst_split_tokens",
                self.prompt_burst_split_tokens,
                "0 or unset with async_scheduling (a step is planned before the one ahead of it has run)",
                problem="is not allowed",
            )

    @property
    def token_budget(self) -> int:
        """The per-iteration token budget, once the engine has resolved it for its device.

        NOTE: the default depends on the device, known only when the engine starts; it
        writes the value from :func:`choose_token_budget` into ``max_num_batched_tokens``,
        so every reader (scheduler, checks, CUDA profiling) sees that same number.
        """
        if self.max_num_batched_tokens is None:
            raise RuntimeError("the token budget depends on the device: resolve it with choose_token_budget() first")
        return self.max_num_batched_tokens

    def with_token_budget(self, budget: TokenBudget) -> SchedulerConfig:
        """This config with its token budget resolved (what the engine runs with)."""
        return dataclasses.replace(
            self,
            max_num_batched_tokens=budget.tokens,
            max_prefill_tokens_while_decoding=budget.prefill_while_decoding,
            prompt_burst_split_tokens=budget.burst_split,
        )


DEFAULT_TOKEN_BUDGETS = {"cpu": 4096, "cuda": 2048}
"""Per-iteration token budget when ``max_num_batched_tokens`` is unset, by device type.

NOTE: on CPU a step's time grows with its tokens while throughput does not (on 2 cores
budgets 256-2048 gave the same tokens/s, ``benchmarks/prefill_budget.py``); what the
budget decides is how prompts that arrive together are batched. A large one prefills them
in one step (two for a large burst, :data:`DEFAULT_BURST_SPLIT`), so they decode and finish
together, and running streams are stalled only
where :data:`DEFAULT_PREFILL_WHILE_DECODING` lets them be. On CUDA it is vLLM's default.
"""

DEFAULT_PREFILL_WHILE_DECODING: dict[str, int | None] = {"cpu": 256, "cuda": None}
"""``max_prefill_tokens_while_decoding`` when unset (with chunked prefill on), by device type.

NOTE: on CPU a step's prompt tokens cost about 0.23 ms each in float32 on 2 cores (the
GEMMs run at their peak from about 64 rows on), so 256 of them stall every decoding stream
for about 60 ms on top of its decode step, where a 4096-token step would stall it for ~1 s.
"""

DEFAULT_BURST_SPLIT: dict[str, int] = {"cpu": 512, "cuda": 0}
"""``prompt_burst_split_tokens`` when unset, by device type.

NOTE: on CPU a step of prompts is compute-bound: eight 256-token prompts arriving together
take one step of seconds, and every one of them gets its first token at its end. Prefilled
in two halves (the GEMMs run at the same rate from a few hundred rows on), the first half
answers at half that time and no token of any stream comes later: the first half's streams
wait for the second half's step, so the burst still decodes and finishes together (see
:data:`DEFAULT_TOKEN_BUDGETS`). More than two parts would answer sooner still, but each
part adds one first-to-second-token gap to the streams answered before it. Below ~512
tokens a step is short and splitting gains nothing.
"""


@dataclass(frozen=True)
class TokenBudget:
    tokens: int
    reason: str
    """Where the number came from, for the start-up log."""
    prefill_while_decoding: int | None = None
    """Prompt tokens per step while more sequences decode than prompts wait (None: the whole budget)."""
    burst_split: int = 0
    """Prompt tokens above which a burst that arrives while nothing decodes is prefilled in two steps (0: never)."""


def choose_token_budget(config: SchedulerConfig, device_type: str, max_model_len: int) -> TokenBudget:
    """The per-iteration token budget on ``device_type`` (``cpu`` or ``cuda``).

    An explicit ``max_num_batched_tokens`` always wins (the engine refuses it later if it
    cannot hold a whole prompt with chunked prefill off). Otherwise the device's default,
    raised to fit one token per running sequence (``max_num_seqs``) and, with chunked
    prefill off, the longest prompt (``max_model_len``), as vLLM does.
    """
    check_choice("device", device_type, [d for d in DEVICES if d != "auto"])
    cap = config.max_prefill_tokens_while_decoding
    if cap is None and config.enable_chunked_prefill:
        cap = DEFAULT_PREFILL_WHILE_DECODING[device_type]
    burst = config.prompt_burst_split_tokens
    if burst is None:
        burst = 0 if config.async_scheduling else DEFAULT_BURST_SPLIT[device_type]
    if config.max_num_batched_tokens is not None:
        return TokenBudget(config.max_num_batched_tokens, "set by max_num_batched_tokens", cap, burst)
    default = DEFAULT_TOKEN_BUDGETS[device_type]
    tokens, reason = default, f"the {device_type} default"
    if config.max_num_seqs > tokens:
        tokens, reason = (
            config.max_num_seqs,
            f"max_num_seqs, one token per sequence (the {device_type} default is {default})",
        )
    if not config.enable_chunked_prefill and max_model_len > tokens:
        tokens, reason = (
            max_model_len,
            f"max_model_len, chunked prefill being off (the {device_type} default is {default})",
        )
    return TokenBudget(tokens, reason, cap, burst)
