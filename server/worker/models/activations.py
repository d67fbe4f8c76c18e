"""Feed-forward activations by their Hugging Face ``activation_function`` / ``hidden_act`` names.

Only the activations the supported families use are listed; each computes exactly what
``transformers.activations.ACT2FN`` computes for the same name, so logits match.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU, written out as in the original TensorFlow code."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": nn.functional.relu,
    "gelu": nn.functional.gelu,
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_fast": gelu_fast,
    "quick_gelu": quick_gelu,
    "silu": nn.functional.silu,
    "swish": nn.functional.silu,
}


def activation(name: str, field: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called ``name``; ``field`` names the config entry in the error."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported: choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
