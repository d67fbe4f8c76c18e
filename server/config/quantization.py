"""Which quantized format a checkpoint uses, read once from ``quantization_config`` or ``--quantization``.

Torch-free, like all configuration: the API server and the operator read it too.

One frozen :class:`QuantConfig` per model says how every quantized linear layer stores its
weight. Anything this engine cannot run exactly is refused here, at start-up, with the value
and what is allowed, never half-loaded::

    quant_method          format here        weights                          activations
    awq (gemm)            awq                4-bit, groups, zero points        as the model's dtype
    gptq                  gptq               4/8-bit, groups, sym or not, g_idx
    compressed-tensors    pack-quantized     4/8-bit int, groups or channels
                          int8-w8a8          int8 per channel                  dynamic per token
                          fp8-w8a8           fp8 e4m3 per tensor / channel
    fp8 (block-wise)      fp8-block          fp8 e4m3, 128 x 128 block scales
    --quantization int8   online-int8        int8 per channel, quantized at load
    --quantization fp8    online-fp8         fp8 e4m3 per channel, quantized at load
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.server.config.checks import ConfigError
from pagedllm.server.config.model import QUANTIZATIONS

ONLINE = {"fp8": "online-fp8", "int8": "online-int8"}
FORMATS = ("awq", "gptq", "pack-quantized", "int8-w8a8", "fp8-w8a8", "fp8-block", "online-int8", "online-fp8")
_FIELD = "quantization_config"


@dataclass(frozen=True)
class QuantConfig:
    """How the linear layers of one model store their weights."""

    method: str
    """The checkpoint's ``quant_method`` (or the online method of ``--quantization``)."""
    format: str
    """One of :data:`FORMATS`: the tensor layout the loader expects."""
    bits: int = 4
    """Bits per weight."""
    group_size: int = -1
    """Input features sharing one scale (and zero point); -1: one group per output channel."""
    sym: bool = True
    """No stored zero points: the zero is the middle level (``2 ** (bits - 1)``)."""
    desc_act: bool = False
    """GPTQ act-order: input features are grouped through ``g_idx``, not by position."""
    zeros_minus_one: bool = False
    """GPTQ's original (v1) layout stores each zero point minus one."""
    block: tuple[int, int] | None = None
    """Weight-block scales [out, in] (the block-wise fp8 format)."""
    per_tensor: bool = False
    """One weight scale for the whole tensor (fp8 W8A8's ``tensor`` strategy), not one per channel."""

    def describe(self) -> dict[str, str]:
        """Labels for the start-up banner and ``quant_config_info``."""
        return {
            "method": self.method,
            "format": self.format,
            "bits": str(self.bits),
            "group_size": str(self.group_size),
            "sym": str(self.sym),
            "desc_act": str(self.desc_act),
        }


@dataclass(frozen=True)
class WeightsSummary:
    """The loaded weights as they run: their format, the kernel of each kind of linear layer and their bytes.

    Built by the worker once the weights are in; the start-up banner and ``quant_config_info`` show it.
    """

    quant: QuantConfig | None
    """How the projections are quantized (None: plain weights)."""
    dtype_bits: int
    """Bits of the model's dtype (what plain weights and activations take)."""
    kernels: tuple[tuple[str, str], ...]
    """(linear kind, kernel) pairs, e.g. ``("qkv_proj", "int4-cpu")``; a kind run by several kernels lists them."""
    weight_bytes: int
    """Bytes the weights take as they run on this rank (packed levels, scales and zero points included)."""

    def labels(self) -> dict[str, str]:
        """The ``quant_config_info`` labels: method, format, bits, group size, one kernel label per kind, bytes."""
        if self.quant is not None:
            base = self.quant.describe()
        else:
            base = {"method": "none", "format": "none", "bits": str(self.dtype_bits), "group_size": "-1"}
            base |= {"sym": "", "desc_act": ""}
        kernels = {f"kernel_{kind}": kernel for kind, kernel in self.kernels}
        return {**base, **kernels, "weight_bytes": str(self.weight_bytes)}

    def banner(self) -> str:
        """One line for the start-up banner, e.g. ``awq awq 4-bit group 128, kernels: qkv_proj int4-cpu, ...``."""
        q = self.quant
        if q is None:
            head = f"none ({self.dtype_bits}-bit)"
        else:
            group = "per channel" if q.group_size < 0 else f"group {q.group_size}"
            head = f"{q.method} {q.format} {q.bits}-bit {group}"
        kernels = ", ".join(f"{kind} {kernel}" for kind, kernel in self.kernels)
        return f"{head}, kernels: {kernels}, weights {self.weight_bytes / 2**20:.2f} MiB"


def quant_config_from_hf(hf_config: dict) -> QuantConfig | None:
    """The checkpoint's :class:`QuantConfig`, or None for an unquantized model (refuses what is unsupported)."""
    qc = hf_config.get(_FIELD)
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    parsers = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors, "fp8": _fp8_block}
    if method == "online":
        return QuantConfig(method=qc["method"], format=ONLINE[qc["method"]], bits=8)
    if method not in parsers:
        raise ConfigError(f"{_FIELD}.quant_method", method, f"one of {sorted(parsers)}", problem="is not supported")
    _check_ignored(qc.get("modules_to_not_convert") or qc.get("ignore") or [])
    return parsers[method](qc)


def with_quantization(hf_config: dict, quantization: str | None) -> dict:
    """``hf_config`` with ``--quantization`` applied: checked against the checkpoint, or online.

    NOTE: idempotent, since tensor-parallel ranks apply it to the driver's config again.
    """
    if quantization is None:
        return hf_config
    if quantization not in QUANTIZATIONS:
        raise ConfigError("quantization", quantization, f"one of {list(QUANTIZATIONS)}")
    own = (hf_config.get(_FIELD) or {}).get("quant_method")
    if own == "online":
        return hf_config
    if own is None and quantization in ONLINE:
        return {**hf_config, _FIELD: {"quant_method": "online", "method": quantization}}
    if own != quantization:
        allowed = f"{own!r} (what the checkpoint holds)" if own else f"one of {sorted(ONLINE)} (quantized at load)"
        raise ConfigError("quantization", quantization, allowed, problem="does not match the checkpoint")
    return hf_config


def _awq(qc: dict) -> QuantConfig:
    version = str(qc.get("version", "gemm")).lower()
    _check("version", version, ("gemm",))
    _check("bits", qc.get("bits", qc.get("w_bit")), (4,))
    group = _check("group_size", qc.get("group_size", qc.get("q_group_size")), (32, 64, 128))
    _check("zero_point", qc.get("zero_point", True), (True,))
    return QuantConfig(method="awq", format="awq", bits=4, group_size=group, sym=False)


def _gptq(qc: dict) -> QuantConfig:
    bits = _check("bits", qc.get("bits"), (4, 8))
    group = _check("group_size", qc.get("group_size", 128), (-1, 32, 64, 128, 256))
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    _check("checkpoint_format", fmt, ("gptq", "gptq_v2"))
    return QuantConfig(
        method="gptq",
        format="gptq",
        bits=bits,
        group_size=group,
        sym=bool(qc.get("sym", True)),
        desc_act=bool(qc.get("desc_act", False)),
        zeros_minus_one=fmt == "gptq",
    )


def _fp8_block(qc: dict) -> QuantConfig:
    _check("fmt", qc.get("fmt", "e4m3"), ("e4m3",))
    _check("activation_scheme", qc.get("activation_scheme", "dynamic"), ("dynamic",))
    block = qc.get("weight_block_size")
    if block is None or len(block) != 2:
        raise ConfigError(f"{_FIELD}.weight_block_size", block, "[rows, columns], e.g. [128, 128]")
    return QuantConfig(method="fp8", format="fp8-block", bits=8, block=(int(block[0]), int(block[1])))


def _compressed_tensors(qc: dict) -> QuantConfig:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"{_FIELD}.config_groups", sorted(groups), "exactly one group (one scheme for all layers)")
    scheme: dict[str, Any] = next(iter(groups.values()))
    weights, acts = scheme.get("weights") or {}, scheme.get("input_activations")
    fmt = qc.get("format")
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if fmt == "pack-quantized" and kind == "int" and acts is None:
        bits = _check("weights.num_bits", bits, (4, 8))
        _check("weights.strategy", strategy, ("group", "channel"))
        _check("weights.actorder", weights.get("actorder"), (None, False))
        group = int(weights["group_size"]) if strategy == "group" else -1
        return QuantConfig("compressed-tensors", "pack-quantized", bits, group, sym=bool(weights.get("symmetric")))
    if fmt in ("int-quantized", "naive-quantized", "float-quantized") and acts is not None:
        _check("input_activations.dynamic", acts.get("dynamic"), (True,))
        _check("input_activations.strategy", acts.get("strategy"), ("token",))
        _check("weights.symmetric", weights.get("symmetric"), (True,))
        if kind == "int":
            _check("weights.strategy", strategy, ("channel",))
            return QuantConfig("compressed-tensors", "int8-w8a8", 8)
        _check("weights.strategy", strategy, ("channel", "tensor"))
        return QuantConfig("compressed-tensors", "fp8-w8a8", 8, per_tensor=strategy == "tensor")
    shown = f"format={fmt}, weights={kind}{bits} {strategy}, activations={'none' if acts is None else acts.get('type')}"
    raise ConfigError(
        _FIELD,
        shown,
        "pack-quantized int4/int8 weight-only, int8 W8A8 (channel/token) or fp8 W8A8 (tensor or channel/token)",
        problem="is not supported",
        subject=f"compressed-tensors scheme ({shown})",
    )


def _check(name: str, value: Any, allowed: tuple) -> Any:
    if value not in allowed:
        raise ConfigError(f"{_FIELD}.{name}", value, f"one of {list(allowed)}", problem="is not supported")
    return value


def _check_ignored(names: list[str]) -> None:
    """Only the LM head may stay unquantized: every projection of every layer is built quantized."""
    others = [n for n in names if n not in ("lm_head", "re:.*lm_head")]
    if others:
        raise ConfigError(f"{_FIELD}.ignore", others, "only lm_head (left unquantized)", problem="is not supported")
