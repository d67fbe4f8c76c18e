"""What the engine reads about a model before loading its weights: limits, EOS, tokenizer, defaults."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from pagedllm.server.config import ConfigError, EngineConfig
from pagedllm.server.config.quantization import WeightsSummary

SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ModelInfo:
    """The loaded model as its callers see it (read-only, safe to share between threads)."""

    model_dir: str
    tokenizer_dir: str
    max_model_len: int
    """Longest prompt plus output the engine serves (the model's limit, the flag and the cache agree)."""
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_window: int | None = None
    """Positions every layer's attention window spans when all layers slide (see :func:`kv_window`), else None."""
    default_sampling: dict[str, Any] = field(default_factory=dict)
    """Sampling defaults from the model's generation_config.json (temperature, top_p, ...)."""
    pooling_type: str = "last"
    """How embedding requests pool hidden states when they do not say (see :func:`pooling_type`)."""
    weights: WeightsSummary | None = None
    """The loaded weights: quantization, each linear kind's kernel, bytes (None until they are loaded)."""


def read_model_info(config: EngineConfig, hf_config: dict[str, Any], tokenizer: Any) -> ModelInfo:
    model_dir = config.model.model
    assert model_dir is not None, "the model directory is resolved before the engine reads it"
    return ModelInfo(
        model_dir=model_dir,
        tokenizer_dir=config.model.tokenizer or model_dir,
        max_model_len=max_model_len(config, hf_config),
        vocab_size=hf_config["vocab_size"],
        eos_token_ids=eos_token_ids(model_dir, hf_config, tokenizer),
        kv_window=kv_window(hf_config),
        default_sampling=default_sampling(model_dir),
        pooling_type=pooling_type(config, model_dir),
    )


def load_tokenizer(path: str) -> Any:
    """The tokenizer at ``path``, or a ValueError where there is none to load.

    NOTE: from a directory without tokenizer files, transformers builds the config's tokenizer class
    with a vocabulary of one token, which turns every text into no tokens: a server would then
    answer every prompt as if it were empty.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if len(tokenizer) <= 1:
        raise ValueError(
            f"no tokenizer at {path!r} (its vocabulary has {len(tokenizer)} token): point --tokenizer "
            "(tokenizer=) at a directory or Hub id that holds one, or pass --skip-tokenizer-init "
            "(skip_tokenizer_init=True) and send token ids"
        )
    return tokenizer


def _generation_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def eos_token_ids(model_dir: str, hf_config: dict[str, Any], tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's, else config.json's, else the tokenizer's."""
    ids = _generation_config(model_dir).get("eos_token_id", hf_config.get("eos_token_id"))
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (ids,)


def default_sampling(model_dir: str) -> dict[str, Any]:
    """The model's own sampling defaults, as vLLM applies them (``--generation-config auto``)."""
    config = _generation_config(model_dir)
    return {k: config[k] for k in SAMPLING_DEFAULT_KEYS if config.get(k) is not None}


# sentence-transformers' Pooling modes -> ours; any other mode set to true is refused.
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def pooling_type(config: EngineConfig, model_dir: str) -> str:
    """``--pooling-type`` if given, else the model's sentence-transformers pooling, else ``last``.

    A sentence-transformers checkpoint lists its modules in ``modules.json``; the one of type
    ``sentence_transformers.models.Pooling`` keeps its ``config.json`` in its ``path``
    (``1_Pooling``), with one ``pooling_mode_*`` flag set.
    """
    if config.model.pooling_type is not None:
        return config.model.pooling_type
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return "last"
    with open(modules_path) as f:
        modules = json.load(f)
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    config_path = os.path.join(model_dir, pooling.get("path", ""), "config.json") if pooling else ""
    if not os.path.isfile(config_path):
        return "last"
    with open(config_path) as f:
        modes = [key for key, on in json.load(f).items() if key.startswith("pooling_mode_") and on is True]
    if len(modes) == 1 and modes[0] in _SENTENCE_TRANSFORMERS_MODES:
        return _SENTENCE_TRANSFORMERS_MODES[modes[0]]
    raise ConfigError(
        "pooling_type",
        modes,
        "give last or mean explicitly",
        problem="is not supported",
        subject=f"{{name}} from {config_path} ({', '.join(modes) or 'no pooling mode set'})",
    )


def max_model_len(config: EngineConfig, hf_config: dict[str, Any]) -> int:
    """``--max-model-len`` if given (never above the model's own limit), else that limit.

    NOTE: a sliding window does not limit the length: attention masks what lies before
    the window, so a sequence may run to ``max_position_embeddings``.
    """
    limit = hf_config.get("max_position_embeddings") or hf_config.get("n_positions") or 2048
    asked: int | None = config.model.max_model_len
    if asked is not None and asked > limit:
        raise ConfigError(
            "max_model_len",
            asked,
            f"at most the model's limit of {limit} positions",
            problem="is larger than the model allows",
        )
    return asked or limit


# NOTE: families whose configs interleave windowed and global layers by a rule of their
# own when ``layer_types`` is absent (older checkpoints): their global layers need every block.
_INTERLEAVED_FAMILIES = ("gemma2", "gemma3", "gemma3_text", "cohere2")


def kv_window(hf_config: dict[str, Any]) -> int | None:
    """The window past which no layer looks, when every layer slides; None when any layer
    attends to its whole context (or none slides).

    Blocks of a sequence wholly before this many positions back from its next query are
    dead for every layer and can be freed. Windows that differ per layer give the largest.

    - ``layer_types`` (newer configs): "sliding_attention" layers use ``sliding_window``;
      any other layer type (``full_attention``) means None;
    - ``use_sliding_window: false`` (Qwen2/Qwen3) means None;
    - Qwen2-style ``max_window_layers``: the layers below it are global, so None unless it is 0;
    - families that interleave by their own rule (Gemma 2/3) without ``layer_types``: None;
    - else ``sliding_window`` (Mistral, Phi-3), if set, applies to every layer.
    """
    window = hf_config.get("sliding_window")
    if not window or hf_config.get("use_sliding_window") is False:
        return None
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        return window if layer_types and all(t == "sliding_attention" for t in layer_types) else None
    if hf_config.get("use_sliding_window") and hf_config.get("max_window_layers", 0) > 0:
        return None
    if hf_config.get("model_type") in _INTERLEAVED_FAMILIES or "sliding_window_pattern" in hf_config:
        return None
    return int(window)
