"""Resident LoRA adapters of one model rank: stacked slot weights and the term they add to each projection.

Each adaptable projection gets a forward hook; the projection itself (whatever it does
inside, prepacked weights included) is untouched, and the hook adds the LoRA term of
each token's slot to its output::

    slot      0        1        2   ...  max_loras        (0: the base model, always zero)
    a[s]      [R, in]  lora_A of the adapter resident in slot s, zero-padded to R = max_lora_rank
    b[s]      [out, R] scaling * lora_B, zero-padded

    column-parallel (q, k, v, gate, up):  y_local += (x @ a[s].T) @ b_local[s].T
        A replicated, B cut by the projection's own output rows (its ``weight.shard``)
    row-parallel (o, down):               y += all_reduce(x_local @ a_local[s].T) @ b[s].T
        A cut by the projection's input columns, B replicated; the all-reduce is R wide

NOTE: the row-parallel split all-reduces the [tokens, R] intermediate, not the
[tokens, out] product (vLLM's non-fully-sharded scheme): a small extra collective per
adapted row-parallel projection, and every rank must take it whenever the step has any
adapter token. Every rank gets the same :class:`StepLoRA`, so they all agree.

On CUDA (with the Triton attention backend) the Triton kernels run; on CPU the grouped
torch matmuls, one pair per slot in the step. The hooks read the step's mapping from
:attr:`LoRAModel.step`, set by the model runner around the forward pass
(:meth:`LoRAModel.running`) and None otherwise, so a step without adapter tokens runs the
base model alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.kernels import HAS_TRITON
from pagedllm.kernels.lora_matmul import (
    SlotPlan,
    lora_expand,
    lora_expand_reference,
    lora_shrink,
    lora_shrink_reference,
    plan_slots,
)
from pagedllm.server.config import ConfigError, LoRAConfig
from pagedllm.server.lora_request import LoRARequest
from pagedllm.server.worker.lora_adapter import ROW_PARALLEL, TARGETS, AdapterInfo, Key, inspect_adapter, load_adapter
from pagedllm.server.worker.model_step import StepLoRA
from pagedllm.server.worker.models.tensor_parallel import TPGroup


@dataclass
class _Step:
    token_slots: torch.Tensor
    plan: SlotPlan


class LoRAProjection:
    """One projection's slot weights, and the hook that adds their term to its output."""

    def __init__(self, layer: nn.Module, owner: LoRAModel, row_parallel: bool, full: tuple[int, int]) -> None:
        # NOTE: a quantized projection has no plain weight; it describes one (shape, dtype, shard rule)
        layout = getattr(layer, "lora_layout", None)
        weight: torch.Tensor = layout() if layout is not None else layer.weight  # type: ignore[assignment]
        out_local, in_local = weight.shape
        slots, rank, dtype, device = owner.num_slots, owner.max_rank, weight.dtype, weight.device
        self.owner = owner
        self.row_parallel = row_parallel
        self.shard = getattr(weight, "shard", None)
        # column: A [R, in] whole, B [out_local, R]; row: A [R, in_local], B [out, R] whole.
        self.a = torch.zeros(slots, rank, in_local if row_parallel else full[1], dtype=dtype, device=device)
        self.b = torch.zeros(slots, full[0] if row_parallel else out_local, rank, dtype=dtype, device=device)
        layer.register_forward_hook(self._hook)

    def write(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put this rank's share of ``a`` [r, in] and ``b`` [out, r] in ``slot`` (None: not adapted, zeros)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if a is None or b is None:
            return
        if self.shard is not None:
            a = self.shard(a) if self.row_parallel else a
            b = b if self.row_parallel else self.shard(b)
        r = a.shape[0]
        self.a[slot, :r] = a.to(self.a.device)
        self.b[slot, :, :r] = b.to(self.b.device)

    def _hook(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        step = self.owner.step
        if step is None:
            return None
        x = inputs[0]
        xa = self.owner.shrink(x, self.a, step)
        if self.row_parallel:
            xa = self.owner.tp.all_reduce(xa)
        self.owner.expand(output, xa, self.b, step)  # NOTE: in place; the projection's output is fresh
        return output


class LoRAModel:
    """The adapter slots of one rank's model: which adapter each holds, and the hooks that use them."""

    def __init__(self, model: Any, config: LoRAConfig, tp: TPGroup, use_triton: bool = False) -> None:
        """``use_triton``: the Triton kernels (where attention runs Triton: CUDA, or CPU through the
        interpreter in tests) instead of the grouped torch matmuls."""
        self.shapes = adaptable_shapes(model)
        self.num_slots = config.max_loras + 1
        self.max_rank = config.max_lora_rank
        self.tp = tp
        self.resident: list[LoRARequest | None] = [None] * self.num_slots
        self.ranks = [0] * self.num_slots
        self.step: _Step | None = None
        layers = model.model.layers
        self.projections = {
            key: LoRAProjection(_projection(layers[key[0]], key[1]), self, key[1] in ROW_PARALLEL, shape)
            for key, shape in self.shapes.items()
        }
        self.dtype = next(iter(self.projections.values())).a.dtype
        self._use_triton = use_triton and HAS_TRITON

    def check(self, request: LoRARequest) -> AdapterInfo:
        """Refuse (:class:`ConfigError`) an adapter that does not fit this model, reading headers only."""
        return inspect_adapter(request, self.shapes, self.max_rank)

    def load(self, slot: int, request: LoRARequest) -> None:
        """Read ``request``'s adapter into ``slot`` (every projection: the ones it does not adapt get zeros)."""
        adapter = load_adapter(request, self.shapes, self.max_rank, self.dtype)
        for key, projection in self.projections.items():
            a, b = adapter.weights.get(key, (None, None))
            projection.write(slot, a, b)
        self.resident[slot] = request
        self.ranks[slot] = adapter.rank

    @contextlib.contextmanager
    def running(self, lora: StepLoRA | None, device: torch.device) -> Iterator[None]:
        """Within the block, the projections add the step's adapter terms (none when ``lora`` is None)."""
        if lora is None:
            yield
            return
        for slot, request in lora.adapters:
            if self.resident[slot] != request:  # NOTE: the whole request: an id reloaded from another path reloads
                self.load(slot, request)
        token_slots = torch.from_numpy(lora.token_slots).to(device)
        self.step = _Step(token_slots, plan_slots(token_slots, self.ranks))
        try:
            yield
        finally:
            self.step = None

    def shrink(self, x: torch.Tensor, a: torch.Tensor, step: _Step) -> torch.Tensor:
        if self._use_triton:
            return lora_shrink(x, a, step.token_slots)
        return lora_shrink_reference(x, a, step.token_slots, step.plan)

    def expand(self, y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, step: _Step) -> None:
        if self._use_triton:
            lora_expand(y, xa, b, step.token_slots)
        else:
            lora_expand_reference(y, xa, b, step.token_slots, step.plan)


def adaptable_shapes(model: Any) -> dict[Key, tuple[int, int]]:
    """The full (out, in) features of every projection an adapter may adapt, per layer.

    Only the LLaMA-like decoder is adaptable; its mixture-of-experts layers keep their MLP unadapted.
    """
    from pagedllm.server.worker.models.decoder import DecoderForCausalLM

    arch = getattr(model, "arch", None)
    if not isinstance(model, DecoderForCausalLM) or arch is None:
        raise ConfigError(
            "enable_lora",
            True,
            "serve a LLaMA-like decoder model",
            problem=f"is not supported for {type(model).__name__}",
        )
    heads, kv, hidden = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size
    attention = {"q_proj": (heads, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, heads)}
    inner = arch.intermediate_size
    mlp = {"gate_proj": (inner, hidden), "up_proj": (inner, hidden), "down_proj": (hidden, inner)}
    shapes: dict[Key, tuple[int, int]] = {}
    for layer in range(arch.num_layers):
        shapes.update({(layer, proj): shape for proj, shape in attention.items()})
        if not arch.moe_layers[layer]:
            shapes.update({(layer, proj): shape for proj, shape in mlp.items()})
    return shapes


def _projection(layer: Any, proj: str) -> nn.Module:
    assert proj in TARGETS
    return getattr(layer.self_attn if proj in TARGETS[:4] else layer.mlp, proj)
