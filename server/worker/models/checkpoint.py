"""Copying checkpoint tensors into a model's parameters, checked name by name."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def copy_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], family: str) -> None:
    """Copy ``(name, tensor)`` pairs into ``model``; every parameter must be filled once.

    The caller has already renamed the tensors to the model's parameter names, laid them
    out as the parameters expect and dropped the ones the model does not keep (tied heads,
    cached masks). ``family`` names the model in errors.
    """
    params = dict(model.named_parameters())
    loaded = set()
    for name, tensor in weights:
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
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:5]}")


def require(cfg: dict, *keys: str) -> int:
    """The first of ``keys`` present in a Hugging Face config (aliases such as n_embd / hidden_size)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise ValueError(f"model config has no {' / '.join(keys)}: it is required for {cfg.get('architectures')}")
