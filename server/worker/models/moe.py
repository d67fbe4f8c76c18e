"""The sparse mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE), expert-parallel.

Each token goes to the ``top_k`` experts its router scores highest and gets their outputs
summed, weighted by the router's probabilities::

    probs = softmax(gate(x))  (float32)      [tokens, experts]
    w, e  = top_k(probs)                     [tokens, top_k]   (w renormalised to sum 1 if asked)
    y     = sum_j w_j * expert_{e_j}(x)      expert(x) = down(act(gate_proj(x)) * up_proj(x))

The experts run grouped, not per token: the (token, slot) pairs are sorted by expert, so
each expert's rows are contiguous and it runs as one matmul over them
(:mod:`pagedllm.kernels.fused_moe`: Triton on CUDA, its torch reference elsewhere)::

    pairs sorted by expert   [ e0 e0 e0 | e1 | (e2: none) | e3 e3 ]
    rows = x[token of pair]  one gate/up matmul and one down matmul per expert's slice
    y.index_add_(0, token of pair, rows_out * w of pair)

Tensor parallelism splits the experts, not their weights: rank r holds experts
``[r*E/tp, (r+1)*E/tp)`` whole, the router is replicated, every rank routes every token,
adds up its own experts' contributions and the ranks' partial sums are all-reduced.

A quantized checkpoint's experts stay quantized (no ``w13`` / ``w2``): each is three quantized
layers run over its rows in turn (:mod:`pagedllm.server.worker.quantization.experts`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pagedllm.kernels.fused_moe import fused_moe, fused_moe_reference
from pagedllm.server.config import ConfigError
from pagedllm.server.config.quantization import QuantConfig
from pagedllm.server.worker.models.activations import activation
from pagedllm.server.worker.models.tensor_parallel import TPGroup
from pagedllm.server.worker.quantization.experts import QuantizedExperts, keeps_experts_quantized

_EXPERT_TENSOR = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_QUANTIZED_TENSOR = re.compile(r"experts\.(\d+)\.(\w+)\.(\w+)")
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class SparseMoeBlock(nn.Module):
    """Router plus this rank's experts; ``forward`` returns the output summed over all ranks.

    Parameters (names chosen so that dummy-weight initialisation treats them as matrices):
    ``gate.weight`` [num_experts, hidden] (the router, replicated), ``w13``
    [local_experts, 2 * intermediate, hidden] (each expert's gate_proj rows, then its
    up_proj rows) and ``w2`` [local_experts, hidden, intermediate] (down_proj).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        hidden_act: str,
        tp: TPGroup = TPGroup(),
        quant: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok={top_k} is not allowed: choose 1 to {num_experts} (the number of experts)"
            )
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.act = activation(hidden_act, "hidden_act")
        self.tp = tp
        self.num_local_experts = _experts_per_rank(num_experts, tp)
        self.first_expert = tp.rank * self.num_local_experts
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self._loaded: set[str] = set()
        self.quantized: QuantizedExperts | None = None
        """The experts as quantized layers (a quantized checkpoint), or None: ``w13`` and ``w2`` hold them."""
        if keeps_experts_quantized(quant):
            assert quant is not None
            self.quantized = QuantizedExperts(
                quant, self.num_local_experts, self.first_expert, hidden_size, intermediate_size
            )
            return
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, intermediate_size))

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden], the sum over every rank's experts
        weights, experts = self.route(x)
        return self.tp.all_reduce(self.experts_forward(x, weights, experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, top_k] float32, expert ids [tokens, top_k] int64) of every token."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def experts_forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """This rank's experts' weighted outputs for the routed pairs, in x's dtype: the Triton
        grouped matmul on CUDA, the torch one (one matmul per expert) elsewhere.

        NOTE: the weighted sum is accumulated in float32 (the routing weights stay float32),
        so half-precision inputs are rounded once, at the end, not once per expert.
        """
        if self.quantized is not None:
            return self.quantized(x, weights, experts - self.first_expert, self.act)
        moe = fused_moe if x.is_cuda else fused_moe_reference
        return moe(x, self.w13, self.w2, weights, experts - self.first_expert, self.act)

    # -- loading -------------------------------------------------------------------------------
    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor in, named relative to the block.

        Accepted: ``gate.weight``; per expert ``experts.{e}.gate_proj.weight`` /
        ``up_proj`` / ``down_proj``; or all experts at once, as transformers keeps them,
        ``experts.gate_up_proj`` [E, 2 * intermediate, hidden] (gate rows first) and
        ``experts.down_proj`` [E, hidden, intermediate]. Experts of other ranks are skipped.
        """
        match = _EXPERT_TENSOR.fullmatch(name)
        quantized = _QUANTIZED_TENSOR.fullmatch(name) if self.quantized is not None else None
        if quantized is not None and int(quantized[1]) < self.num_experts:
            assert self.quantized is not None
            self.quantized.load(int(quantized[1]), quantized[2], quantized[3], tensor)
        elif name == "gate.weight":
            self._copy(name, tensor, (self.num_experts, self.hidden_size), self.gate.weight)
            self._loaded.add(name)
        elif match is not None and int(match[1]) < self.num_experts:
            self._load_expert_tensor(int(match[1]), match[2], tensor)
        elif name in ("experts.gate_up_proj", "experts.down_proj"):
            if self.quantized is None:
                self._load_fused(name, tensor)
            else:
                self._load_fused_quantized(name, tensor)
        else:
            raise ValueError(
                f"checkpoint tensor {name!r} is not part of a mixture-of-experts block with "
                f"{self.num_experts} experts: expected gate.weight, experts.{{0..{self.num_experts - 1}}}."
                "{gate_proj,up_proj,down_proj}.weight, experts.gate_up_proj or experts.down_proj"
            )

    def missing_checkpoint_tensors(self) -> list[str]:
        """The canonical names of this rank's tensors that have not been loaded yet."""
        missing = [name for name in self._expected_names() if name not in self._loaded]
        return missing + (self.quantized.missing() if self.quantized is not None else [])

    def _expected_names(self) -> list[str]:
        first, last = self.first_expert, self.first_expert + self.num_local_experts
        if self.quantized is not None:
            return ["gate.weight"]
        return ["gate.weight"] + [f"experts.{e}.{p}.weight" for e in range(first, last) for p in _PROJECTIONS]

    def _load_expert_tensor(self, expert: int, projection: str, tensor: torch.Tensor) -> None:
        name = f"experts.{expert}.{projection}.weight"
        inter, hidden = self.intermediate_size, self.hidden_size
        shape = (hidden, inter) if projection == "down_proj" else (inter, hidden)
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            _check_shape(name, tensor, shape)  # NOTE: another rank's expert: checked, not kept
            return
        if projection == "down_proj":
            target = self.w2[local]
        else:
            target = self.w13[local, :inter] if projection == "gate_proj" else self.w13[local, inter:]
        self._copy(name, tensor, shape, target)
        self._loaded.add(name)

    def _load_fused(self, name: str, tensor: torch.Tensor) -> None:
        target = self.w13 if name == "experts.gate_up_proj" else self.w2
        _check_shape(name, tensor, (self.num_experts, *target.shape[1:]))
        first = self.first_expert
        with torch.no_grad():
            target.copy_(tensor.narrow(0, first, self.num_local_experts))
        projections = ("gate_proj", "up_proj") if name == "experts.gate_up_proj" else ("down_proj",)
        self._loaded.update(
            f"experts.{e}.{p}.weight" for e in range(first, first + self.num_local_experts) for p in projections
        )

    def _load_fused_quantized(self, name: str, tensor: torch.Tensor) -> None:
        """All experts' plain weights at once, into quantized experts (online quantization), one expert at a time."""
        assert self.quantized is not None
        inter, hidden = self.intermediate_size, self.hidden_size
        fused_gate_up = name == "experts.gate_up_proj"
        _check_shape(
            name, tensor, (self.num_experts, 2 * inter, hidden) if fused_gate_up else (self.num_experts, hidden, inter)
        )
        for e in range(self.num_experts):
            if fused_gate_up:
                self.quantized.load(e, "gate_proj", "weight", tensor[e, :inter])
                self.quantized.load(e, "up_proj", "weight", tensor[e, inter:])
            else:
                self.quantized.load(e, "down_proj", "weight", tensor[e])

    def _copy(self, name: str, tensor: torch.Tensor, shape: tuple[int, ...], target: torch.Tensor) -> None:
        _check_shape(name, tensor, shape)
        with torch.no_grad():
            target.copy_(tensor)


def _experts_per_rank(num_experts: int, tp: TPGroup) -> int:
    if num_experts % tp.size:
        raise ConfigError(
            "tensor_parallel_size",
            tp.size,
            f"a divisor of the model's {num_experts} experts",
            problem="is not allowed",
        )
    return num_experts // tp.size


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
