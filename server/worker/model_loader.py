"""Reading a Hugging Face model directory: its config and its weight files."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator

import torch
from torch import nn

from pagedllm.server.hf_config import normalized_config, read_hf_config  # noqa: F401 (re-exported)
from pagedllm.server.worker.models.base import CausalLM


def checkpoint_dtype(hf_config: dict) -> torch.dtype:
    """The dtype the checkpoint's config names (``torch_dtype`` or ``dtype``); float32 if none."""
    name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    return getattr(torch, str(name).replace("torch.", ""), torch.float32)


def iterate_weights(model_dir: str, load_format: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from ``*.safetensors`` or, failing that, ``*.bin`` / ``*.pt`` files."""
    safetensors_files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    torch_files = sorted(glob.glob(os.path.join(model_dir, "*.bin")) + glob.glob(os.path.join(model_dir, "*.pt")))
    use_safetensors = load_format == "safetensors" or (load_format == "auto" and safetensors_files)
    files = safetensors_files if use_safetensors else torch_files
    if not files:
        raise ValueError(
            f"no {'safetensors' if use_safetensors else '.bin/.pt'} weight files in {model_dir!r} "
            f"(load_format={load_format!r})"
        )
    for path in files:
        if use_safetensors:
            from safetensors.torch import load_file

            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
        yield from state.items()


def init_dummy_weights(model: nn.Module | CausalLM, seed: int) -> None:
    """Random weights for benchmarks: normal(0, 0.02) matrices, unit norms.

    NOTE: drawn where each parameter lives, from a generator of that device seeded with
    ``seed``, not in float32 on the host and copied over (an 8B server on an H100 spent 73 s
    between its engine's start and its weights being ready, this draw included). The CPU's
    values are unchanged."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if _is_norm_weight(name):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                if param.device not in generators:
                    generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
                drawn = torch.randn(param.shape, generator=generators[param.device], device=param.device)
                param.copy_(drawn.mul_(0.02))


def _is_norm_weight(name: str) -> bool:
    """LayerNorm / RMSNorm scales: ``*norm.weight``, ``*layernorm*`` and GPT-2's ``ln_1`` / ``ln_f``."""
    return name.endswith("norm.weight") or "layernorm" in name or re.search(r"(^|\.)ln_\w+\.weight$", name) is not None
