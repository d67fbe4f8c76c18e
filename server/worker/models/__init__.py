"""Model architectures, looked up by the ``architectures`` entry of a Hugging Face config."""

from __future__ import annotations

from torch import nn

from pagedllm.server.worker.models.gpt2 import GPT2LMHeadModel
from pagedllm.server.worker.models.llama import LlamaForCausalLM
from pagedllm.server.worker.models.opt import OPTForCausalLM

_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}


def model_class(hf_config: dict) -> type[nn.Module]:
    """The class that runs the checkpoint described by ``hf_config``."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in _REGISTRY:
            return _REGISTRY[name]
    raise ValueError(f"model architectures {names} are not supported: choose one of {sorted(_REGISTRY)}")
