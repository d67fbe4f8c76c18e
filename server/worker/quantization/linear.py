"""A linear layer whose weight is quantized: checkpoint tensors in, one kernel after loading.

The layer is built with the tensors its format keeps (named as in the checkpoint, so the
loader fills them like any parameter), each marked with how tensor parallelism cuts it::

    column parallel   cut along the output features: packed columns with their group scales
    row parallel      cut along the input features, at group boundaries (refused otherwise)

After loading, :func:`finish_quantized_layers` turns them into a
:class:`~pagedllm.server.worker.quantization.base.QuantizedWeight` and then into the kernel
chosen for the device; fused projections (q/k/v, gate/up) stack their parts' weights along
N first. The checkpoint tensors are dropped then, so no weight is held twice.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.server.config import ConfigError
from pagedllm.server.config.quantization import QuantConfig, WeightsSummary
from pagedllm.server.worker.quantization import awq, compressed_tensors, fp8, gptq
from pagedllm.server.worker.quantization.base import QuantizedWeight, TensorSpec, concat_weights

if TYPE_CHECKING:
    from pagedllm.server.worker.models.tensor_parallel import TPGroup

FORMAT_MODULES: dict[str, ModuleType] = {
    "awq": awq,
    "gptq": gptq,
    "pack-quantized": compressed_tensors,
    "int8-w8a8": compressed_tensors,
    "fp8-w8a8": compressed_tensors,
    "fp8-block": fp8,
    "online-int8": fp8,
    "online-fp8": fp8,
}


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with W quantized; column- or row-parallel like the plain layers."""

    kernel: nn.Module | None
    perm: torch.Tensor | None
    bias: nn.Parameter | None
    _pending: QuantizedWeight
    """The weight between loading and :meth:`finish`, where fusing had to read it first."""

    def __init__(
        self,
        cfg: QuantConfig,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        row_parallel: bool = False,
        first_row: int | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.tp, self.row_parallel = cfg, tp, row_parallel
        n_local = out_features if row_parallel or first_row is not None else tp.split(out_features, "projection width")
        k_local = tp.split(in_features, "projection width") if row_parallel else in_features
        self.shape = (n_local, k_local)
        self.sizes: list[int] | None = None
        """Output widths of the fused parts (q, k, v), or None for one projection."""
        self.kernel: nn.Module | None = None
        self.perm: torch.Tensor | None = None
        self.parts: list[QuantLinear] = []
        out_start = first_row if first_row is not None else tp.rank * n_local
        self.plain_cut = (None, tp.rank * k_local, k_local) if row_parallel else (out_start, None, n_local)
        """Where this rank's slice of a plain [out, in] weight lies: (output start, input start, length)."""
        self.dtype = torch.get_default_dtype()
        for spec in FORMAT_MODULES[cfg.format].specs(cfg, k_local, n_local, in_features):
            param = nn.Parameter(torch.empty(spec.shape, dtype=spec.dtype), requires_grad=False)
            self.register_parameter(spec.name, param)
            if tp.size > 1:
                cut = (None, tp.rank * k_local, k_local) if row_parallel else (out_start, None, n_local)
                mark_shard(param, _shard_rule(spec, cut))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features if row_parallel else n_local))
            if tp.size > 1 and not row_parallel:
                mark_shard(self.bias, lambda full: full.narrow(0, out_start, n_local))

    def quantized_weight(self) -> QuantizedWeight:
        """The loaded checkpoint tensors as one :class:`QuantizedWeight` (drops them: call once)."""
        names = [name for name, _ in self.named_parameters(recurse=False) if name != "bias"]
        tensors = {name: getattr(self, name).detach() for name in names}
        for name in names:
            delattr(self, name)
        return FORMAT_MODULES[self.cfg.format].to_weight(self.cfg, tensors)

    def finish(self, device: torch.device, dtype: torch.dtype) -> None:
        """Build the kernel from the loaded (or fused) weight."""
        # NOTE: imported here: the kernels' module imports the models package, whose decoder imports this one
        from pagedllm.server.worker.quantization.kernels import choose_kernel

        w = self._pending if self.parts else self.quantized_weight()
        self.parts = []
        self.perm = w.perm
        self.kernel = choose_kernel(w, device, dtype)

    def lora_layout(self) -> torch.Tensor:
        """A weight-shaped stand-in ([out, in] of this rank, no memory) with the plain weight's shard rule.

        LoRA sizes and cuts its adapters by the projection's weight; a quantized one has none.
        """
        device = self.kernel_device()
        layout = torch.zeros((), dtype=self.dtype, device=device).expand(*self.shape)
        if self.tp.size > 1:
            out_start, in_start, length = self.plain_cut
            dim, start = (0, out_start) if in_start is None else (1, in_start)
            assert start is not None
            mark_shard(layout, lambda full: full.narrow(dim, start, length))
        return layout

    def kernel_device(self) -> torch.device:
        buffers = list(self.buffers()) + list(self.parameters())
        return buffers[0].device if buffers else torch.device("cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # NOTE: a decode step makes ~100 of these calls: 2-D x (the model's) skips the reshapes, the kernel's
        # forward is called as it is (nothing hooks a kernel module), and the kernel and bias are read from
        # the module's dicts (its attribute lookup took ~1 us each)
        kernel = self._modules.get("kernel")
        assert kernel is not None, "finish_quantized_layers runs after loading"
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        y = kernel.forward(x) if x.dim() == 2 else kernel.forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        if self.row_parallel:
            y = self.tp.all_reduce(y)
        bias = self._parameters.get("bias")
        if bias is not None:
            y = y + bias
        return y.split_with_sizes(self.sizes, -1) if self.sizes is not None else y

    @classmethod
    def fused(cls, parts: list[QuantLinear]) -> QuantLinear | None:
        """One layer for parts of the same input (stacked along N), or None when they cannot share it."""
        weights = [p.quantized_weight() for p in parts]
        stacked = concat_weights(weights)
        if stacked is None:  # NOTE: act-order: each part reads the input in its own order; keep them apart
            for part, w in zip(parts, weights):
                part._pending, part.parts = w, [part]
            return None
        layer = parts[0]
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.cfg, fused.tp, fused.row_parallel = layer.cfg, layer.tp, False
        fused.shape = (sum(p.shape[0] for p in parts), layer.shape[1])
        fused.sizes = [p.shape[0] for p in parts]
        fused.kernel, fused.perm = None, None
        fused._pending, fused.parts = stacked, list(parts)
        biases = [p.bias for p in parts]
        fused.bias = None
        if any(b is not None for b in biases):
            filled = [b.detach() if b is not None else torch.zeros(p.shape[0]) for b, p in zip(biases, parts)]
            fused.bias = nn.Parameter(torch.cat(filled), requires_grad=False)
        return fused


def mark_shard(t: torch.Tensor, rule) -> None:
    """:func:`~pagedllm.server.worker.models.tensor_parallel.mark_shard`, imported when first needed.

    NOTE: the decoder imports this module as it loads, and any import from the models package
    loads the decoder first; importing this module on its own must not start that cycle.
    """
    from pagedllm.server.worker.models.tensor_parallel import mark_shard as mark

    mark(t, rule)


def _shard_rule(spec: TensorSpec, cut: tuple[int | None, int | None, int]):
    """This rank's slice of a full checkpoint tensor: (output start, input start, length) in features."""
    out_start, in_start, length = cut
    dim, unit, start = (
        (spec.out_dim, spec.out_unit, out_start) if in_start is None else (spec.in_dim, spec.in_unit, in_start)
    )
    if dim is None:
        return lambda full: full
    assert start is not None
    if start % unit or length % unit:
        side = "output" if in_start is None else "input"
        raise ConfigError(
            "tensor_parallel_size",
            "this size",
            f"shards of whole {unit}-feature units ({spec.name}: {side} features {start}..{start + length})",
            problem="cuts a packed or grouped tensor",
            subject=f"tensor parallelism over {spec.name}",
        )
    return lambda full: full.narrow(dim, start // unit, length // unit)


def finish_quantized_layers(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Build every quantized layer's kernel (after loading and fusing); how many there are."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for layer in layers:
        layer.finish(device, dtype)
    return len(layers)


def weights_summary(model: nn.Module, dtype: torch.dtype) -> WeightsSummary:
    """What ``model``'s weights are and which kernel runs each kind of linear layer, for the banner and
    ``quant_config_info``; a model without quantized layers is method ``none``."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return WeightsSummary(
        quant=layers[0].cfg if layers else None,
        dtype_bits=torch.finfo(dtype).bits,
        kernels=linear_kernels(model),
        weight_bytes=weight_bytes(model),
    )


def linear_kernels(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """(kind, kernel) of every kind of linear layer in ``model``: the layer's name without its position
    (``qkv_proj``, ``experts_down_proj``, ``lm_head``), and what runs it on this device."""
    found: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        kernel = _kernel_label(module)
        if kernel is None:
            continue
        parts = name.split(".")
        kind = ("experts_" if "experts" in parts[:-1] else "") + parts[-1]
        found.setdefault(kind, set()).add(kernel)
    return tuple((kind, "+".join(sorted(kernels))) for kind, kernels in sorted(found.items()))


def _kernel_label(module: nn.Module) -> str | None:
    """What runs ``module``'s product, or None when it is no linear layer.

    NOTE: imported here, not at the top, for the cycle :func:`mark_shard` explains.
    """
    from pagedllm.server.worker.models.cpu_linear import PackableLinear, packed_kernel

    if isinstance(module, QuantLinear):
        return getattr(module.kernel, "label", getattr(module.kernel, "name", None))
    if isinstance(module, PackableLinear) and isinstance(getattr(module, "weight", None), torch.Tensor):
        return packed_kernel(module.weight)
    return None


def weight_bytes(model: nn.Module) -> int:
    """Bytes ``model``'s weights take as they run (this rank): every parameter, and what each quantized
    layer's kernel keeps (packed levels, scales, zero points, act-order permutation)."""
    tensors: dict[int, torch.Tensor] = {id(t): t for t in model.parameters()}
    for layer in model.modules():
        if isinstance(layer, QuantLinear):
            tensors.update((id(t), t) for t in layer.buffers())
            if layer.perm is not None:
                tensors[id(layer.perm)] = layer.perm
    return sum(t.numel() * t.element_size() for t in tensors.values())
