"""Random PEFT LoRA adapters on tiny checkpoints, and the merged transformers model as their oracle."""

from __future__ import annotations

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_random_adapter(
    base_dir: str,
    adapter_dir: str,
    seed: int,
    rank: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ALL_TARGETS,
    merged_dir: str | None = None,
    **lora_args,
) -> str:
    """Write a PEFT adapter of ``base_dir`` with random A and B (PEFT starts B at zero) to ``adapter_dir``.

    With ``merged_dir``, also save the base with the adapter merged in (``merge_and_unload``): the reference.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **lora_args)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    model.save_pretrained(adapter_dir)
    if merged_dir is not None:
        model.merge_and_unload().save_pretrained(merged_dir, safe_serialization=True)
    return adapter_dir
