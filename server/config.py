"""Engine configuration: frozen dataclasses validated once, at the edge.

Every engine argument is a field of exactly one of the sub-configs below. The
``LLM(...)`` keyword arguments, the ``pagedllm`` CLI flags (``--block-size`` for
``block_size``) and the operator's rendered command line are all derived from these
fields (see :mod:`pagedllm.server.args`), so there is one source of truth.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
PREEMPTION_MODES = (None, "recompute", "swap")
ATTENTION_BACKENDS = ("auto", "numba", "torch", "triton")
POOLING_TYPES = ("last", "mean")
"""Embedding pooling: ``last`` takes the last prompt token's final hidden state (vLLM's default for
``*ForCausalLM`` used as embedding models), ``mean`` averages every prompt position's."""
KV_RESERVATIONS = ("paged", "max", "pow2", "oracle")  # kept equal to core.kv_reservation's (config stays import-light)
GiB = 1 << 30


class ConfigError(ValueError):
    """A value outside what is allowed, carrying the field it is about as data.

    ``field`` is the engine's own name (``block_size``, ``best_of``, ``prompt_token_ids``).
    Each edge shows the error under its own name for that field with :meth:`renamed`:
    the CLI as ``--block-size``, the operator as ``spec.blockSize``, the HTTP API as the
    OpenAI ``param``. Nothing parses the message to find the field.
    """

    def __init__(
        self,
        field: str,
        value: Any,
        allowed: str = "",
        *,
        problem: str = "is not allowed",
        subject: str | None = None,
        name: str | None = None,
    ) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        self.problem = problem
        self.subject = subject
        """How the value is shown when ``name=value`` would read badly, with ``{name}`` for the name."""
        self.name = name or field
        super().__init__(self.message)

    @property
    def message(self) -> str:
        shown = self.subject.format(name=self.name) if self.subject else f"{self.name}={self.value!r}"
        head = " ".join(part for part in (shown, self.problem) if part)
        return f"{head}: {self.allowed}" if self.allowed else head

    def renamed(self, name: str) -> ConfigError:
        """The same error, shown under ``name`` (a flag, a spec path, a request parameter)."""
        return ConfigError(self.field, self.value, self.allowed, problem=self.problem, subject=self.subject, name=name)

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: keyword-only arguments are not in ``args``: without this it cannot cross a process boundary.
        return _rebuild_config_error, (self.field, self.value, self.allowed, self.problem, self.subject, self.name)


def _rebuild_config_error(
    field: str, value: Any, allowed: str, problem: str, subject: str | None, name: str
) -> ConfigError:
    return ConfigError(field, value, allowed, problem=problem, subject=subject, name=name)


def _help(text: str, **extra: Any) -> dict:
    return {"help": text, **extra}


def check_range(name: str, value: Any, low: Any = None, high: Any = None, *, low_open: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``value`` is None or within the bounds."""
    if value is None:
        return
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        lo = "" if low is None else (f"> {low}" if low_open else f">= {low}")
        hi = "" if high is None else f"<= {high}"
        allowed = " and ".join(s for s in (lo, hi) if s)
        raise ConfigError(name, value, f"must be {allowed}", problem="is out of range")


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    """Raise :class:`ConfigError` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(name, value, f"choose one of {list(choices)}")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(
        default=None, metadata=_help("Hugging Face model directory (default: the embedded demo model).")
    )
    tokenizer: str | None = field(default=None, metadata=_help("Tokenizer directory; defaults to the model directory."))
    dtype: str = field(
        default="auto",
        metadata=_help(
            "Weight and activation dtype; auto = the checkpoint's (on CPU: bfloat16 for 16-bit "
            "checkpoints where the CPU has AVX-512-BF16 or AMX, else float32).",
            choices=DTYPES,
        ),
    )
    device: str = field(
        default="auto", metadata=_help("Where the model runs; auto picks cuda when available.", choices=DEVICES)
    )
    max_model_len: int | None = field(
        default=None, metadata=_help("Longest prompt plus output, in tokens; defaults to the model's limit.")
    )
    load_format: str = field(
        default="auto", metadata=_help("Weight format; dummy draws random weights (benchmarks).", choices=LOAD_FORMATS)
    )
    seed: int = field(default=0, metadata=_help("Seed for random weights and unseeded sampling."))
    skip_tokenizer_init: bool = field(
        default=False, metadata=_help("Do not load a tokenizer; prompts must be token ids.")
    )
    attention_backend: str = field(
        default="auto",
        metadata=_help(
            "Attention implementation; auto = triton on CUDA, numba on CPU (torch where numba is missing).",
            choices=ATTENTION_BACKENDS,
        ),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=_help(
            "On CUDA, run every step eagerly: no CUDA graphs of the decode step (they take memory and start-up time)."
        ),
    )
    pooling_type: str | None = field(
        default=None,
        metadata=_help(
            "How /v1/embeddings pools hidden states: last or mean; default: the model's sentence-transformers"
            " 1_Pooling/config.json if it has one, else last.",
            choices=(None, *POOLING_TYPES),
        ),
    )

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("device", self.device, DEVICES)
        check_choice("load_format", self.load_format, LOAD_FORMATS)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_range("max_model_len", self.max_model_len, 1)
        check_choice("pooling_type", self.pooling_type, (None, *POOLING_TYPES))


KV_EVENT_PUBLISHERS = ("null", "zmq")
KV_EVENT_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events for prefix-aware routers, given as vLLM's ``--kv-events-config`` JSON.

    An ``endpoint`` with ``*`` (``tcp://*:5557``), ``::``, or an ``ipc://`` / ``inproc://``
    one is bound and subscribers connect to it; any other (``tcp://router:5557``) is
    connected to a subscriber that binds, as in vLLM.
    """

    enable_kv_cache_events: bool = False
    """Record prefix-cache events (needs prefix caching)."""
    publisher: str | None = None
    """``zmq`` or ``null`` (nothing sent); default: zmq when enabled."""
    endpoint: str = "tcp://*:5557"
    """The ZeroMQ PUB socket's address."""
    replay_endpoint: str | None = None
    """A ROUTER address where a subscriber asks for recent batches again from a sequence number."""
    buffer_steps: int = 10_000
    """Batches (steps with events) kept for replay."""
    hwm: int = 100_000
    """ZeroMQ's high-water mark of the PUB socket: messages queued per subscriber before dropping."""
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread; when full the oldest is dropped (and counted)."""
    topic: str = ""
    """Sent as the first frame of every message; llm-d reads ``kv@<pod>@<model>``."""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        check_choice("kv_events_config.publisher", self.publisher, KV_EVENT_PUBLISHERS)
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.startswith(KV_EVENT_ENDPOINT_SCHEMES)):
                raise ConfigError(
                    f"kv_events_config.{name}",
                    value,
                    f"a ZeroMQ address starting with one of {list(KV_EVENT_ENDPOINT_SCHEMES)}",
                )
        check_range("kv_events_config.buffer_steps", self.buffer_steps, 0)
        check_range("kv_events_config.hwm", self.hwm, 0)
        check_range("kv_events_config.max_queue_size", self.max_queue_size, 1)

    @property
    def enabled(self) -> bool:
        """Events are recorded and sent."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: str | dict[str, Any] | KVEventsConfig) -> KVEventsConfig:
        """From the JSON text of the flag, a dict of its keys, or an instance; errors name the key at fault."""
        if isinstance(value, KVEventsConfig):
            return value
        return cls(**_json_object("kv_events_config", value, cls))


def _check_json_type(name: str, value: Any, annotation: str) -> None:
    """Refuse a JSON value of another kind than the field's annotation (``"str | None"``) names."""
    allowed = annotation.split(" | ")
    if value is None:
        ok = "None" in allowed
    elif isinstance(value, bool):  # NOTE: before int, which bool is a subclass of
        ok = "bool" in allowed
    else:
        ok = any(isinstance(value, kind) for word, kind in (("int", int), ("str", str)) if word in allowed)
    if not ok:
        raise ConfigError(name, value, f"must be of type {annotation}", problem="has the wrong type")


DEFAULT_BLOCK_SIZES = {"cpu": 64, "cuda": 16}
"""Tokens per KV cache block when ``block_size`` is unset, by device type.

NOTE: the CPU decode kernel reads a sequence's blocks one after another, and each block
that lies elsewhere in memory starts a new stream the CPU's prefetcher has to find: at 16
tokens (16-32 KB per layer) the kernel waits on memory. At 64 it takes 25-40% less time
per call (``python -m benchmarks.cpu_attention --block-sizes 16 64 --layers 8``) and a
decode step 0.4-1 ms less (``benchmarks/step_profile.py``); vLLM's CPU build defaults to
128 for the same reason. The cost is coarser sharing: prefix caching reuses whole blocks
only, and a fork copies up to a block. On CUDA 16 is vLLM's default.
"""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = field(
        default=None,
        metadata=_help("Tokens per KV cache block (a power of two, 1-256; default: 16 on CUDA, 64 on CPU)."),
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=_help("Fraction of GPU memory the engine may use (weights + activations + KV cache).")
    )
    swap_space: float = field(default=4.0, metadata=_help("GiB of host memory for swapped-out KV blocks."))
    kv_cache_memory: float = field(
        default=1.0, metadata=_help("GiB of KV cache on CPU (ignored on CUDA, where it is profiled).")
    )
    num_gpu_blocks_override: int | None = field(
        default=None, metadata=_help("Use exactly this many device KV blocks (default: sized from memory).")
    )
    enable_prefix_caching: bool = field(default=True, metadata=_help("Reuse KV blocks of prompts that share a prefix."))
    kv_reservation: str = field(
        default="paged",
        metadata=_help(
            "Benchmarks only: paged, or reserve at admission as the paper's Orca baselines do"
            " (max = max_model_len, pow2 = next power of two of prompt + output, oracle = prompt + output).",
            choices=KV_RESERVATIONS,
            benchmark_only=True,
        ),
    )
    kv_events_config: KVEventsConfig | None = field(
        default=None,
        metadata=_help(
            "Publish KV-cache events for prefix-aware routers, as vLLM's JSON, e.g. "
            """{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv@POD@MODEL"}"""
            " (default: off).",
            flag_type=str,  # NOTE: the text goes to the config, whose errors name the key at fault
        ),
    )

    def __post_init__(self) -> None:
        if self.kv_events_config is not None:
            # NOTE: LLM(kv_events_config=...) may give the JSON text or a dict, as the flag does.
            object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        if self.block_size is not None and not (
            isinstance(self.block_size, int)
            and 1 <= self.block_size <= 256
            and self.block_size & (self.block_size - 1) == 0
        ):
            raise ConfigError("block_size", self.block_size, "must be a power of two from 1 to 256")
        check_range("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        check_range("swap_space", self.swap_space, 0)
        check_range("kv_cache_memory", self.kv_cache_memory, 0.0, low_open=True)
        check_range("num_gpu_blocks_override", self.num_gpu_blocks_override, 1)
        check_choice("kv_reservation", self.kv_reservation, KV_RESERVATIONS)
        if self.kv_events_enabled and not self.enable_prefix_caching:
            raise ConfigError(
                "kv_events_config",
                self.kv_events_config,
                "turn prefix caching on (--enable-prefix-caching) or the events off",
                problem="needs prefix caching: only cached blocks have events",
                subject="{name}",
            )

    @property
    def tokens_per_block(self) -> int:
        """``block_size`` once the engine has resolved it for its device (:func:`with_block_size`)."""
        if self.block_size is None:
            raise RuntimeError("the block size depends on the device: resolve it with with_block_size() first")
        return self.block_size

    def with_block_size(self, device_type: str) -> CacheConfig:
        """This config with ``block_size`` resolved for ``device_type`` (an explicit one is kept)."""
        if self.block_size is not None:
            return self
        check_choice("device", device_type, [d for d in DEVICES if d != "auto"])
        return dataclasses.replace(self, block_size=DEFAULT_BLOCK_SIZES[device_type])

    @property
    def kv_events_enabled(self) -> bool:
        """Whether the engine records prefix-cache events and publishes them."""
        return self.kv_events_config is not None and self.kv_events_config.enabled


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
        return cls(**_json_object("speculative_config", value, cls))


def _json_object(name: str, value: str | dict[str, Any], cls: type) -> dict[str, Any]:
    """A JSON-valued flag's keys, checked against the fields of ``cls``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(name, value, f"give a JSON object ({exc.msg})", problem="is not JSON") from exc
    if not isinstance(value, dict):
        raise ConfigError(name, value, "give a JSON object of the fields", problem="is not an object")
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key, item in value.items():
        if key not in known:
            raise ConfigError(f"{name}.{key}", item, f"allowed are {sorted(known)}", problem="is an unknown key")
        _check_json_type(f"{name}.{key}", item, str(known[key].type))
    return value


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=256, metadata=_help("Most sequences running in one iteration."))
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=_help(
            "Token budget of one iteration (prompt chunks + decodes); default 4096 on CPU, 2048 on CUDA,"
            " at least max_model_len with chunked prefill off."
        ),
    )
    max_prefill_tokens_while_decoding: int | None = field(
        default=None,
        metadata=_help(
            "Prompt tokens one iteration computes at most while more sequences decode than prompts wait,"
            " which bounds their inter-token stall; needs chunked prefill (default 256 on CPU, none on CUDA)."
        ),
    )
    preemption_mode: str | None = field(
        default=None,
        metadata=_help("How to preempt (default: recompute single sequences, swap groups).", choices=PREEMPTION_MODES),
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=_help("Split long prompts over several iterations, batched with decodes.")
    )
    speculative_config: SpeculativeConfig | None = field(
        default=None,
        metadata=_help(
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
        if self.max_prefill_tokens_while_decoding is not None and not self.enable_chunked_prefill:
            raise ConfigError(
                "max_prefill_tokens_while_decoding",
                self.max_prefill_tokens_while_decoding,
                "unset when enable_chunked_prefill is off (a prompt could not be split to fit it)",
                problem="is not allowed",
            )
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)

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
            self, max_num_batched_tokens=budget.tokens, max_prefill_tokens_while_decoding=budget.prefill_while_decoding
        )


DEFAULT_TOKEN_BUDGETS = {"cpu": 4096, "cuda": 2048}
"""Per-iteration token budget when ``max_num_batched_tokens`` is unset, by device type.

NOTE: on CPU a step's time grows with its tokens while throughput does not (on 2 cores
budgets 256-2048 gave the same tokens/s, ``benchmarks/prefill_budget.py``); what the
budget decides is how prompts that arrive together are batched. A large one prefills them
in one step, so they decode and finish together, and running streams are stalled only
where :data:`DEFAULT_PREFILL_WHILE_DECODING` lets them be. On CUDA it is vLLM's default.
"""

DEFAULT_PREFILL_WHILE_DECODING: dict[str, int | None] = {"cpu": 256, "cuda": None}
"""``max_prefill_tokens_while_decoding`` when unset (with chunked prefill on), by device type.

NOTE: on CPU a step's prompt tokens cost about 0.23 ms each in float32 on 2 cores (the
GEMMs run at their peak from about 64 rows on), so 256 of them stall every decoding stream
for about 60 ms on top of its decode step, where a 4096-token step would stall it for ~1 s.
"""


@dataclass(frozen=True)
class TokenBudget:
    tokens: int
    reason: str
    """Where the number came from, for the start-up log."""
    prefill_while_decoding: int | None = None
    """Prompt tokens per step while more sequences decode than prompts wait (None: the whole budget)."""


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
    if config.max_num_batched_tokens is not None:
        return TokenBudget(config.max_num_batched_tokens, "set by max_num_batched_tokens", cap)
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
    return TokenBudget(tokens, reason, cap)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field(default=1, metadata=_help("Number of ranks the model is split over."))
    cpu_threads: int | None = field(
        default=None,
        metadata=_help("torch's intra-op threads; default: OMP_NUM_THREADS, else the CPUs the cgroup quota allows."),
    )

    nnodes: int = field(
        default=1,
        metadata=_help(
            "Hosts the tensor-parallel ranks are spread over, tensor_parallel_size / nnodes on each; "
            "node 0 runs the engine and the HTTP server, the others run `serve --headless`."
        ),
    )
    node_rank: int = field(default=0, metadata=_help("This host's index among the nnodes (0: the engine)."))
    master_addr: str = field(
        default="127.0.0.1", metadata=_help("Address of node 0, where the other nodes' ranks connect.")
    )
    master_port: int = field(
        default=29501,
        metadata=_help("Port on node 0 for the ranks' control channel; torch.distributed's store takes the next one."),
    )

    def __post_init__(self) -> None:
        check_range("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_range("cpu_threads", self.cpu_threads, 1)
        check_range("nnodes", self.nnodes, 1)
        check_range("node_rank", self.node_rank, 0, self.nnodes - 1)
        check_range("master_port", self.master_port, 1, 65534)
        if self.tensor_parallel_size % self.nnodes:
            raise ConfigError(
                "nnodes",
                self.nnodes,
                f"a divisor of tensor_parallel_size={self.tensor_parallel_size} (every node holds as many ranks)",
            )

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def node_of(self, rank: int) -> int:
        """The node that holds tensor-parallel ``rank``: ranks are dealt out in blocks, node 0 first."""
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        """``rank``'s index on its own node (its CUDA device there)."""
        return rank % self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)


MAX_LORA_RANKS = (1, 8, 16, 32, 64)
"""Ranks ``max_lora_rank`` may take (vLLM's list, up to 64); an adapter of any rank up to it loads."""


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = field(default=False, metadata=_help("Serve LoRA adapters (PEFT directories) per request."))
    max_loras: int = field(
        default=1, metadata=_help("Adapters resident at once (one batch mixes them); others load on demand.")
    )
    max_lora_rank: int = field(
        default=16, metadata=_help("Largest adapter rank accepted (sizes the resident slots).", choices=MAX_LORA_RANKS)
    )

    def __post_init__(self) -> None:
        check_range("max_loras", self.max_loras, 1)
        check_choice("max_lora_rank", self.max_lora_rank, MAX_LORA_RANKS)


SUB_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, combined from the sub-configs."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Route flat engine arguments (``block_size=16, ...``) to their sub-config."""
        known = {f.name: sub for sub in SUB_CONFIGS for f in dataclasses.fields(sub)}
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ConfigError(
                unknown[0], kwargs[unknown[0]], f"allowed are {sorted(known)}", problem="is an unknown engine argument"
            )
        parts: dict[type, dict[str, Any]] = {sub: {} for sub in SUB_CONFIGS}
        for name, value in kwargs.items():
            parts[known[name]][name] = value
        return cls(
            ModelConfig(**parts[ModelConfig]),
            CacheConfig(**parts[CacheConfig]),
            SchedulerConfig(**parts[SchedulerConfig]),
            ParallelConfig(**parts[ParallelConfig]),
            LoRAConfig(**parts[LoRAConfig]),
        )


def engine_fields() -> list[dataclasses.Field]:
    """The engine arguments a deployment sets (CLI flags, the CRD), in declaration order.

    NOTE: fields marked ``benchmark_only`` are left out: ``LLM(...)`` accepts them, a server does not.
    """
    return [f for sub in SUB_CONFIGS for f in dataclasses.fields(sub) if not f.metadata.get("benchmark_only")]
