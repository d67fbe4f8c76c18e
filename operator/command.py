"""The server's command line, rendered from a ``PagedLLM`` spec.

Every engine flag is built with :func:`pagedllm.server.args.flag_for` from the engine
field the spec key maps to (``blockSize`` -> ``block_size`` -> ``--block-size``), so the
operator and the server cannot drift apart; ``tests/operator/test_server_command.py``
parses the rendered arguments with the real `pagedllm serve` parser to prove it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pagedllm.operator.spec import PagedLLMSpec, SpecError
from pagedllm.server.args import flag_for

# The container entrypoint; the Dockerfile's ENTRYPOINT must be the same (a test checks it).
SERVE_COMMAND = ("pagedllm", "serve")

# The API key reaches the server through this variable (from spec.apiKeySecret), never argv.
API_KEY_ENV = "PAGEDLLM_API_KEY"

# spec key -> engine field (pagedllm.server.config); the flag is flag_for(field).
ENGINE_FIELDS: Mapping[str, str] = {
    "model": "model",
    "dtype": "dtype",
    "maxModelLen": "max_model_len",
    "blockSize": "block_size",
    "gpuMemoryUtilization": "gpu_memory_utilization",
    "swapSpaceGiB": "swap_space",
    "enablePrefixCaching": "enable_prefix_caching",
    "kvCacheDtype": "kv_cache_dtype",
    "quantization": "quantization",
    "maxNumSeqs": "max_num_seqs",
    "maxNumBatchedTokens": "max_num_batched_tokens",
    "preemptionMode": "preemption_mode",
    "tensorParallelSize": "tensor_parallel_size",
    "seed": "seed",
    "loadFormat": "load_format",
    "speculativeConfig": "speculative_config",
    "enableLora": "enable_lora",
    "maxLoras": "max_loras",
    "maxLoraRank": "max_lora_rank",
}

# spec key -> flag of `pagedllm serve` that is not an engine field (pagedllm.server.entrypoints.serve).
SERVE_FIELDS: Mapping[str, str] = {
    "port": "--port",
    "servedModelName": "--served-model-name",
    "maxQueueLen": "--max-queue-len",
    "drainTimeoutSeconds": "--drain-timeout",
    "logLevel": "--log-level",
}

# Other spellings `pagedllm serve` accepts for a flag the spec owns.
FLAG_ALIASES: Mapping[str, str] = {"--max-waiting-requests": "--max-queue-len"}

# Flags the operator renders that no single spec key sets: flag -> who owns it.
OPERATOR_FLAGS: Mapping[str, str] = {
    "--host": "the operator",  # the probes and the Service need 0.0.0.0
    "--api-key": "spec.apiKeySecret",
    "--lora-modules": "spec.adapters",
    "--device": "the operator",  # the pods run on the GPUs they request
    "--headless": "spec.nodes",
    "--nnodes": "spec.nodes",
    "--node-rank": "spec.nodes",
    "--master-addr": "spec.nodes",
    "--master-port": "spec.nodes",
}

# Flags that extraArgs may not set: those rendered from the spec (and their aliases), plus
# the operator's own (--api-key would show the key in the pod spec; the group layout flags
# are rendered for spec.nodes > 1 and would break a one-pod replica). A test checks this
# covers every option string of those destinations and every flag any rendering emits.
OWNED_FLAGS = frozenset(
    [flag_for(f) for f in ENGINE_FIELDS.values()]
    + ["--no-" + flag_for(f)[2:] for f in ENGINE_FIELDS.values()]
    + list(SERVE_FIELDS.values())
    + list(FLAG_ALIASES)
    + list(OPERATOR_FLAGS)
)


def spec_value(spec: PagedLLMSpec, key: str) -> Any:
    """The value of the spec field whose CRD key is ``key``."""
    return getattr(spec, spec_attr(key))


def spec_attr(key: str) -> str:
    for f in PagedLLMSpec.__dataclass_fields__.values():
        if f.metadata["key"] == key:
            return f.name
    raise KeyError(f"no spec field has the CRD key {key!r}")


def _flag_args(flag: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        return [flag] if value else ["--no-" + flag[2:]]
    if isinstance(value, Mapping):  # a JSON-valued flag (--speculative-config)
        return [flag, json.dumps(dict(value), sort_keys=True)]
    return [flag, str(value)]


def server_args(spec: PagedLLMSpec, model_path: str) -> list[str]:
    """The arguments after ``pagedllm serve``; ``model_path`` is where the pod sees the model."""
    args = ["--host", "0.0.0.0"]
    for key, engine_field in ENGINE_FIELDS.items():
        value = _rendered_value(spec, key, model_path)
        if value is not None:
            args += _flag_args(flag_for(engine_field), value)
    served_name = spec.served_model_name or spec.model
    for key, flag in SERVE_FIELDS.items():
        value = served_name if key == "servedModelName" else spec_value(spec, key)
        if value is not None:
            args += _flag_args(flag, value)
    return args + list(checked_extra_args(spec.extra_args))


def _rendered_value(spec: PagedLLMSpec, key: str, model_path: str | None) -> Any:
    if key == "model":
        return model_path
    if key == "enableLora":  # NOTE: rendered only when on, so a spec without LoRA keeps its command line
        return True if spec.lora_enabled else None
    return spec_value(spec, key)


def checked_extra_args(extra_args: tuple[str, ...]) -> tuple[str, ...]:
    """``extra_args`` unless one of them sets a flag the spec owns (then :class:`SpecError`)."""
    for index, arg in enumerate(extra_args):
        owned = owned_flags_named(arg)
        if not owned:
            continue
        word = arg.split("=", 1)[0]
        what = (
            f"{word} is rendered from {_owner_of(word)}"
            if word in OWNED_FLAGS
            else f"{word} abbreviates {' or '.join(owned)}, rendered from "
            + " or ".join(sorted({_owner_of(flag) for flag in owned}))
        )
        raise SpecError(f"spec.extraArgs[{index}]={arg!r} is not allowed: {what}; set that instead")
    return extra_args


def owned_flags_named(arg: str) -> list[str]:
    """The owned flags ``arg`` may set when argparse reads it: the flag itself, or every owned
    flag it is a prefix of (argparse takes an unambiguous prefix as the whole flag), with or
    without ``=value``.

    NOTE: `pagedllm serve` refuses abbreviations (``allow_abbrev=False``), but an older image
    would still expand them, so the operator refuses them whatever the image.
    """
    if not arg.startswith("--") or arg == "--":
        return []
    word = arg.split("=", 1)[0]
    if word in OWNED_FLAGS:
        return [word]
    return sorted(flag for flag in OWNED_FLAGS if flag.startswith(word))


def _owner_of(flag: str) -> str:
    flag = FLAG_ALIASES.get(flag, flag)
    bare = flag.replace("--no-", "--")
    for key, engine_field in ENGINE_FIELDS.items():
        if flag_for(engine_field) == bare:
            return f"spec.{key}"
    for key, serve_flag in SERVE_FIELDS.items():
        if serve_flag == flag:
            return f"spec.{key}"
    return OPERATOR_FLAGS.get(flag, "the operator")


def engine_kwargs(spec: PagedLLMSpec, model_path: str | None = None) -> dict[str, Any]:
    """The engine keyword arguments the rendered flags stand for (for validation and tests)."""
    values = {field: _rendered_value(spec, key, model_path) for key, field in ENGINE_FIELDS.items()}
    return {field: value for field, value in values.items() if value is not None}  # None: the engine's default


def check_engine(spec: PagedLLMSpec, model_path: str) -> None:
    """Validate the rendered engine arguments with the engine's own config classes.

    Raises :class:`SpecError` naming the spec key, so a value the server would refuse at
    start-up is reported on the resource instead of crash-looping its pods; then the whole
    rendered command line, ``extraArgs`` included, goes through `pagedllm serve`'s parser.
    """
    from pagedllm.server.config import ConfigError, EngineConfig

    try:
        EngineConfig.from_kwargs(**engine_kwargs(spec, model_path))
    except ConfigError as exc:
        base, dot, sub = exc.field.partition(".")  # a key inside a JSON-valued field keeps its spelling
        key = next((k for k, field in ENGINE_FIELDS.items() if field == base), None)
        raise SpecError(exc.renamed(f"spec.{key}{dot}{sub}" if key else exc.name).message) from exc
    from pagedllm.operator.serve_check import check_serve_args

    check_serve_args(server_args(spec, model_path), spec.extra_args)
