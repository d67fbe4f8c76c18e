"""LoRA adapters in PEFT's format: reading a directory and checking it fits the loaded model.

A PEFT directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``rank_pattern`` / ``alpha_pattern``, ``target_modules``, ``base_model_name_or_path``) and
``adapter_model.safetensors`` with, per adapted projection::

    base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_B.weight   [out, r]

    y = x @ W.T + scaling * (x @ A.T) @ B.T,   scaling = alpha / r  (alpha / sqrt(r) with rsLoRA)

The scaling is folded into ``B`` when the adapter is read, so the step multiplies twice.
Every shape is checked against the model before a request is queued: an adapter trained
on another base fails with a :class:`ConfigError` that names the tensor and both shapes.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from pagedllm.server.config import ConfigError
from pagedllm.server.lora_request import LoRARequest

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Projections an adapter may adapt: attention's four and the gated MLP's three."""
ROW_PARALLEL = ("o_proj", "down_proj")
"""Of :data:`TARGETS`, those whose input features are split across tensor-parallel ranks."""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

Key = tuple[int, str]
"""(layer index, projection name)."""


@dataclass(frozen=True)
class AdapterInfo:
    """What was checked of an adapter without reading its weights."""

    rank: int
    """The largest rank of its projections."""
    base_model: str | None
    shapes: dict[Key, tuple[tuple[int, ...], tuple[int, ...]]]
    """(A shape, B shape) of each adapted projection."""


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights, ready to be written into a slot: ``A`` [r, in] and ``scaling * B`` [out, r]."""

    request: LoRARequest
    rank: int
    weights: dict[Key, tuple[torch.Tensor, torch.Tensor]]


def _fail(request: LoRARequest, allowed: str, problem: str = "does not fit the loaded model") -> ConfigError:
    return ConfigError(
        "lora_request",
        request.lora_name,
        allowed,
        problem=problem,
        subject=f"LoRA adapter {request.lora_name!r} ({request.lora_path})",
    )


def read_adapter_config(request: LoRARequest) -> dict:
    path = os.path.join(request.lora_path, CONFIG_FILE)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(request.lora_path, WEIGHTS_FILE)):
        raise _fail(request, f"a PEFT directory with {CONFIG_FILE} and {WEIGHTS_FILE}", problem="is not an adapter")
    with open(path) as f:
        config = json.load(f)
    unsupported = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
    }
    bad = [key for key, is_bad in unsupported.items() if is_bad]
    if bad:
        raise _fail(
            request,
            f"plain LoRA on {list(TARGETS)} without bias, DoRA or saved modules",
            problem=f"sets {bad[0]}={config.get(bad[0])!r}, which is not supported",
        )
    return config


def inspect_adapter(request: LoRARequest, shapes: dict[Key, tuple[int, int]], max_rank: int) -> AdapterInfo:
    """Check the adapter's config and tensor shapes (headers only) against the model's.

    ``shapes`` maps each adaptable (layer, projection) to the model's full (out, in) features.
    """
    from safetensors import safe_open

    config = read_adapter_config(request)
    base = config.get("base_model_name_or_path")
    found: dict[Key, dict[str, tuple[int, ...]]] = {}
    with safe_open(os.path.join(request.lora_path, WEIGHTS_FILE), framework="pt") as f:
        for name in f.keys():
            match = _TENSOR.match(name)
            if match is None or (int(match[1]), match[2]) not in shapes:
                raise _fail(request, f"LoRA on {list(TARGETS)} of this model's layers", problem=f"has tensor {name!r}")
            found.setdefault((int(match[1]), match[2]), {})[match[3]] = tuple(f.get_slice(name).get_shape())
    if not found:
        raise _fail(request, "at least one lora_A / lora_B pair", problem="has no LoRA tensors")
    pairs = {key: _check_pair(request, key, parts, shapes[key], max_rank, base) for key, parts in found.items()}
    return AdapterInfo(max(a[0] for a, _ in pairs.values()), base, pairs)


def _check_pair(request, key: Key, parts: dict, shape: tuple[int, int], max_rank: int, base) -> tuple:
    layer, proj = key
    where = f"model.layers.{layer}.{proj}"
    if set(parts) != {"A", "B"}:
        raise _fail(request, "both lora_A and lora_B", problem=f"has only lora_{''.join(parts)} for {where}")
    a, b = parts["A"], parts["B"]
    out_features, in_features = shape
    rank = a[0]
    trained_on = f" (it was trained on {base!r})" if base else ""
    if len(a) != 2 or len(b) != 2 or a[1] != in_features or b[0] != out_features or b[1] != rank:
        raise _fail(
            request,
            f"this model's {proj} maps {in_features} -> {out_features} features{trained_on}",
            problem=f"does not fit the loaded model: {where} has lora_A {list(a)} and lora_B {list(b)}",
        )
    if rank > max_rank:
        raise _fail(
            request, f"at most max_lora_rank={max_rank}", problem=f"has rank {rank} at {where}, above the limit"
        )
    return a, b


def load_adapter(
    request: LoRARequest, shapes: dict[Key, tuple[int, int]], max_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """Read and check the adapter; ``B`` comes back multiplied by its projection's scaling."""
    from safetensors.torch import load_file

    info = inspect_adapter(request, shapes, max_rank)
    config = read_adapter_config(request)
    tensors = load_file(os.path.join(request.lora_path, WEIGHTS_FILE))
    weights = {}
    for layer, proj in info.shapes:
        prefix = f"base_model.model.model.layers.{layer}.{'self_attn' if proj in TARGETS[:4] else 'mlp'}.{proj}"
        a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
        scale = scaling(config, f"model.layers.{layer}.{proj}", a.shape[0])
        weights[(layer, proj)] = (a.to(dtype), (b.float() * scale).to(dtype))
    return LoRAAdapter(request, info.rank, weights)


def scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), with ``alpha_pattern`` applied to ``module``."""
    alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8)))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule: a pattern key matches a module whose dotted name ends with it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
