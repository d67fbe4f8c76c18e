"""LoRA adapters served per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.server.config.checks import check_choice, check_range, field_help

MAX_LORA_RANKS = (1, 8, 16, 32, 64)
"""Ranks ``max_lora_rank`` may take (vLLM's list, up to 64); an adapter of any rank up to it loads."""


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = field(default=False, metadata=field_help("Serve LoRA adapters (PEFT directories) per request."))
    max_loras: int = field(
        default=1, metadata=field_help("Adapters resident at once (one batch mixes them); others load on demand.")
    )
    max_lora_rank: int = field(
        default=16,
        metadata=field_help("Largest adapter rank accepted (sizes the resident slots).", choices=MAX_LORA_RANKS),
    )

    def __post_init__(self) -> None:
        check_range("max_loras", self.max_loras, 1)
        check_choice("max_lora_rank", self.max_lora_rank, MAX_LORA_RANKS)
