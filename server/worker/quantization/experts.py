"""Quantized mixture-of-experts checkpoints: each expert's weights are dequantized as they load.

The experts of a sparse MoE block run as grouped matmuls over stacked plain weights
(:mod:`pagedllm.server.worker.models.moe`); there is no grouped quantized kernel yet. So a
quantized checkpoint's expert tensors (``experts.3.gate_proj.qweight``, ``.qzeros``,
``.scales``, ...) are gathered per projection and, once all are in, handed to the block as
the one plain ``experts.3.gate_proj.weight`` it expects::

    experts.E.P.{qweight, qzeros, scales} ──gather──► QuantizedWeight ──dequantize──► experts.E.P.weight

NOTE: the experts then take the memory of the model's dtype (the attention and any dense MLP
stay quantized); the router (``gate.weight``) is never quantized. With online quantization
(``--quantization fp8/int8``) the experts stay as the checkpoint has them.
"""

from __future__ import annotations

import re

import torch

from pagedllm.server.config.quantization import QuantConfig
from pagedllm.server.worker.models.checkpoint import TensorLoader

_EXPERT = re.compile(r"(experts\.\d+\.(?:gate_proj|up_proj|down_proj))\.(\w+)")
_PROBE = 1024
"""Input and output widths to ask a format which tensor names a layer has (any multiple of the groups)."""


class DequantizingExperts:
    """A :class:`TensorLoader` in front of a MoE block: quantized expert tensors in, plain weights out."""

    def __init__(self, block: TensorLoader, cfg: QuantConfig, dtype: torch.dtype) -> None:
        from pagedllm.server.worker.quantization.linear import FORMAT_MODULES

        self.block, self.cfg, self.dtype = block, cfg, dtype
        self.module = FORMAT_MODULES[cfg.format]
        self.names = {spec.name for spec in self.module.specs(cfg, _PROBE, _PROBE, _PROBE)}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        match = _EXPERT.fullmatch(name)
        if match is None or match[2] not in self.names or self.cfg.format.startswith("online"):
            self.block.load_checkpoint_tensor(name, tensor)
            return
        parts = self.pending.setdefault(match[1], {})
        parts[match[2]] = tensor
        if set(parts) == self.names:
            del self.pending[match[1]]
            weight = self.module.to_weight(self.cfg, parts)
            if weight.perm is not None:  # NOTE: act-order: put the input features back in their order
                plain = torch.empty_like(weight.dequantize())
                plain[:, weight.perm] = weight.dequantize()
            else:
                plain = weight.dequantize()
            self.block.load_checkpoint_tensor(f"{match[1]}.weight", plain.to(self.dtype))

    def missing_checkpoint_tensors(self) -> list[str]:
        partial = [f"{prefix}.{name}" for prefix, parts in self.pending.items() for name in self.names - set(parts)]
        return partial + self.block.missing_checkpoint_tensors()
