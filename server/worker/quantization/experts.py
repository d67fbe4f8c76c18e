"""Quantized mixture-of-experts experts: each expert's projections stay quantized, as its checkpoint has them.

A quantized checkpoint names its expert tensors one by one (``experts.3.gate_proj.qweight``,
``.qzeros``, ``.scales``, ...). Each of this rank's experts is three
:class:`~pagedllm.server.worker.quantization.linear.QuantLinear` layers built with exactly
those tensors, so they load like any quantized projection and, after loading, take the kernel
chosen for the device (:func:`~pagedllm.server.worker.quantization.linear.finish_quantized_layers`
finds them like the dense ones)::

    experts.E.P.{qweight, qzeros, scales} ──load──► experts[E - first].P (QuantLinear) ──finish──► kernel

The experts run one at a time over their routed rows
(:func:`pagedllm.kernels.fused_moe.grouped_experts`, the loop the plain block's torch path
runs too): no grouped quantized kernel yet, so a quantized MoE trades the single grouped launch
for its smaller memory. The router (``gate.weight``) is never quantized.

NOTE: the loop reads each expert's row count on the host, a device sync: on CUDA, capturing the
decode step as a graph fails on it, and ``try_capture`` leaves such a model's decode steps eager
(by reading; not yet run on a GPU).

With online quantization (``--quantization fp8/int8``) each expert's plain weight is quantized
per output channel as it loads, like a dense projection's; transformers' stacked layout
(``experts.gate_up_proj`` [E, 2 * inter, hidden], ``experts.down_proj``) is cut per expert first.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.fused_moe import Activation, grouped_experts
from pagedllm.server.config.quantization import QuantConfig
from pagedllm.server.worker.models.tensor_parallel import TPGroup

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def keeps_experts_quantized(cfg: QuantConfig | None) -> bool:
    """Whether a MoE block of a model quantized by ``cfg`` holds quantized experts (every format)."""
    return cfg is not None


class QuantizedExpert(nn.Module):
    """One expert's gated MLP with quantized projections: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, cfg: QuantConfig, hidden: int, inter: int) -> None:
        super().__init__()
        from pagedllm.server.worker.quantization.linear import QuantLinear

        one = TPGroup()  # NOTE: expert parallelism keeps each expert whole on its rank
        self.gate_proj = QuantLinear(cfg, hidden, inter, False, one)
        self.up_proj = QuantLinear(cfg, hidden, inter, False, one)
        self.down_proj = QuantLinear(cfg, inter, hidden, False, one)

    def forward(self, x: torch.Tensor, act: Activation) -> torch.Tensor:
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))


class QuantizedExperts(nn.Module):
    """This rank's experts ``[first, first + num_local)``, quantized; loads their tensors by checkpoint name."""

    def __init__(self, cfg: QuantConfig, num_local: int, first: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.first = first
        experts = [QuantizedExpert(cfg, hidden, inter) for _ in range(num_local)]
        self.experts = nn.ModuleList(experts)
        self.tensor_names = [name for name, _ in experts[0].gate_proj.named_parameters(recurse=False)]
        """The checkpoint tensors of one projection (``qweight``, ``scales``, ...)."""
        self._loaded: set[str] = set()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, act: Activation) -> torch.Tensor:
        # x: [tokens, hidden]; weights, experts: [tokens, top_k] (local expert ids) -> [tokens, hidden]
        def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
            return self.experts[expert](rows, act)

        return grouped_experts(x, weights, experts, len(self.experts), expert_mlp)

    def load(self, expert: int, projection: str, tensor_name: str, tensor: torch.Tensor) -> None:
        """Copy ``experts.{expert}.{projection}.{tensor_name}`` in (another rank's expert: skipped)."""
        name = f"experts.{expert}.{projection}.{tensor_name}"
        if projection not in PROJECTIONS or tensor_name not in self.tensor_names:
            allowed = f"experts.{{e}}.{{{','.join(PROJECTIONS)}}}.{{{','.join(self.tensor_names)}}}"
            raise ValueError(f"checkpoint tensor {name!r} is not part of a quantized expert: expected {allowed}")
        local = expert - self.first
        mine = 0 <= local < len(self.experts)
        target = getattr(getattr(self.experts[local if mine else 0], projection), tensor_name)
        if tuple(tensor.shape) != tuple(target.shape):
            shapes = f"{tuple(tensor.shape)}, expected {tuple(target.shape)}"
            raise ValueError(f"checkpoint tensor {name!r} has shape {shapes}")
        if not mine:  # NOTE: another rank's expert: checked, not kept
            return
        with torch.no_grad():
            target.copy_(tensor)
        self._loaded.add(name)

    def expected_names(self) -> list[str]:
        """Every checkpoint tensor name of this rank's experts."""
        last = self.first + len(self.experts)
        return [f"experts.{e}.{p}.{t}" for e in range(self.first, last) for p in PROJECTIONS for t in self.tensor_names]

    def missing(self) -> list[str]:
        return [name for name in self.expected_names() if name not in self._loaded]
