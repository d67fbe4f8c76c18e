"""The dtype the model computes in: the one asked for, or chosen from the checkpoint and the machine.

``dtype=auto``::

    checkpoint          CPU with bf16 units*   other CPU   CUDA
    ------------------  ---------------------  ----------  --------
    bfloat16            bfloat16               float32     bfloat16
    float16             bfloat16               float32     float16
    float32 (or none)   float32                float32     bfloat16

    * AVX-512-BF16 or AMX-BF16: torch's bf16 matmuls run on them through oneDNN.

A CPU without bf16 units converts bfloat16 to float32 inside every op and gains little
or nothing, and float16 matmuls measured several times slower than float32 even on a CPU
with AVX-512-BF16 (it has no float16 units), so half-precision checkpoints run in
bfloat16 only where that is fast. Float32 checkpoints keep float32 on CPU: their tokens
stay exactly those of float32 transformers. An explicit dtype is always used as given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.server.worker.model_loader import checkpoint_dtype

CPUINFO = "/proc/cpuinfo"
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""/proc/cpuinfo flags of x86 units that compute bfloat16 natively, the faster first."""


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str
    """Why, for the start-up log."""


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The flags of :data:`BF16_FLAGS` the CPU reports in ``cpuinfo`` (default :data:`CPUINFO`);
    none where it cannot be read."""
    try:
        with open(cpuinfo or CPUINFO) as f:
            flags_line = next((line for line in f if line.startswith("flags")), "")
    except OSError:  # not Linux, or no /proc: assume no bf16 units
        return []
    flags = set(flags_line.partition(":")[2].split())
    return [flag for flag in BF16_FLAGS if flag in flags]


def choose_dtype(name: str, hf_config: dict, device: torch.device, cpuinfo: str | None = None) -> DtypeChoice:
    """``name`` when given; for ``auto`` see the table in this module's docstring."""
    if name != "auto":
        return DtypeChoice(getattr(torch, name), "dtype asked for")
    stored = checkpoint_dtype(hf_config)
    short = str(stored).removeprefix("torch.")
    if device.type == "cuda":
        if stored == torch.float32:
            return DtypeChoice(torch.bfloat16, "float32 checkpoint, run in bfloat16 on CUDA")
        return DtypeChoice(stored, f"the checkpoint's {short}")
    if stored == torch.float32:
        return DtypeChoice(torch.float32, f"the checkpoint's {short}")
    if stored not in (torch.bfloat16, torch.float16):
        return DtypeChoice(torch.float32, f"{short} checkpoint, run in float32 on CPU")
    units = cpu_bf16_flags(cpuinfo)
    if not units:
        return DtypeChoice(torch.float32, f"{short} checkpoint, but the CPU has no {' or '.join(BF16_FLAGS)}")
    if stored == torch.bfloat16:
        return DtypeChoice(torch.bfloat16, f"the checkpoint's {short}, on a CPU with {units[0]}")
    return DtypeChoice(torch.bfloat16, f"{short} checkpoint, run in bfloat16 on a CPU with {units[0]}")
