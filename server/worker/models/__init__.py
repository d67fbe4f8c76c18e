"""Model architectures, looked up by the ``architectures`` entry of a Hugging Face config."""

from __future__ import annotations

from pagedllm.server.config import ConfigError
from pagedllm.server.worker.models.base import CausalLM
from pagedllm.server.worker.models.decoder import DecoderForCausalLM
from pagedllm.server.worker.models.gpt2 import GPT2LMHeadModel
from pagedllm.server.worker.models.opt import OPTForCausalLM

DECODER_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
"""Hugging Face architectures the one decoder (decoder.py) runs; decoder_arch.py lists what differs."""

_REGISTRY: dict[str, type[CausalLM]] = {
    **dict.fromkeys(DECODER_ARCHITECTURES, DecoderForCausalLM),
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}


def model_class(hf_config: dict) -> type[CausalLM]:
    """The class that runs the checkpoint described by ``hf_config``."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in _REGISTRY:
            if hf_config.get("quantization_config") and _REGISTRY[name] is not DecoderForCausalLM:
                raise ConfigError("quantization", name, f"a LLaMA-like decoder: {list(DECODER_ARCHITECTURES)}")
            return _REGISTRY[name]
    raise ConfigError(
        "architectures",
        names,
        f"choose one of {sorted(_REGISTRY)}",
        problem="are not supported",
        subject=f"model architectures {names}",
    )
