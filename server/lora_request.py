"""Which LoRA adapter a request runs with (vLLM's ``LoRARequest``).

``LoRARequest("sql", 1, "/adapters/sql")`` names a PEFT directory (``adapter_config.json``
and ``adapter_model.safetensors``). The integer id is the adapter's identity in the engine:
requests with the same id share its resident weights and its prefix-cache blocks; two ids
never share KV blocks, even for equal prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.server.config import ConfigError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for one request: a name, a unique positive id and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ConfigError("lora_int_id", self.lora_int_id, "a positive integer (0 is the base model)")
        if not self.lora_name:
            raise ConfigError("lora_name", self.lora_name, "a non-empty name")
        if not self.lora_path:
            raise ConfigError("lora_path", self.lora_path, "the adapter's PEFT directory", problem="is empty")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
