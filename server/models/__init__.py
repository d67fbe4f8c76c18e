"""Model architectures, looked up by the ``architectures`` entry of a Hugging Face config."""

from __future__ import annotations

from torch import nn

from pagedllm.server.models.llama import LlamaForCausalLM

_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


def model_class(hf_config: dict) -> type[nn.Module]:
    """The class that runs the checkpoint described by ``hf_config``."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in _REGISTRY:
            return _REGISTRY[name]
    raise ValueError(f"model architectures {names} are not supported: choose one of {sorted(_REGISTRY)}")
