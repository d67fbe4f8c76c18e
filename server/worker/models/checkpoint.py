"""Copying checkpoint tensors into a model's parameters, checked name by name."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import torch
from torch import nn


class TensorLoader(Protocol):
    """A module that takes its checkpoint tensors itself (stacked experts, say)."""

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None: ...

    def missing_checkpoint_tensors(self) -> list[str]: ...


def copy_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    family: str,
    delegates: Mapping[str, TensorLoader] | None = None,
) -> None:
    """Copy ``(name, tensor)`` pairs into ``model``; every parameter must be filled once.

    The caller has already renamed the tensors to the model's parameter names, laid them
    out as the parameters expect and dropped the ones the model does not keep (tied heads,
    cached masks). ``family`` names the model in errors. A tensor whose name starts with a
    prefix of ``delegates`` goes to that module, by its name after the prefix.
    """
    delegates = delegates or {}
    params = {
        name: param
        for name, param in model.named_parameters()
        if not any(name.startswith(prefix) for prefix in delegates)
    }
    loaded = set()
    for name, tensor in weights:
        prefix = next((p for p in delegates if name.startswith(p)), None)
        if prefix is not None:
            delegates[prefix].load_checkpoint_tensor(name[len(prefix) :], tensor)
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} does not belong to a {family} model")
        param = params[name]
        shard = getattr(param, "shard", None)
        if shard is not None:  # NOTE: tensor parallelism: keep only this rank's slice of the tensor
            tensor = shard(tensor)
        if param.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    missing += [prefix + name for prefix, module in delegates.items() for name in module.missing_checkpoint_tensors()]
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:5]}")


def require(cfg: dict, *keys: str) -> int:
    """The first of ``keys`` present in a Hugging Face config (aliases such as n_embd / hidden_size)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise ValueError(f"model config has no {' / '.join(keys)}: it is required for {cfg.get('architectures')}")
