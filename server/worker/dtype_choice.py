"""The dtype the model computes in: the one asked for, or chosen from the checkpoint and the machine.

``dtype=auto``::

    checkpoint          CPU with bf16 units*   AVX2 CPU**   other CPU   CUDA
    ------------------  ---------------------  -----------  ----------  --------
    bfloat16            bfloat16               bfloat16     float32     bfloat16
    float16             bfloat16               bfloat16     float32     float16
    float32 (or none)   float32                float32      float32     bfloat16

    * AVX-512-BF16 or AMX-BF16: torch's bf16 matmuls run on them through oneDNN, and the
      engine's bf16 GEMM (kernels/bf16_gemm_cpu.py) on VDPBF16PS.
    ** AVX2 and FMA, no bf16 units, where the engine's AVX2 bf16 GEMM runs (a C compiler
       and Numba): it widens bfloat16 weights to float32 in registers, so a decode step
       reads half of float32's bytes (Qwen2.5-0.5B shape, 2 threads, AMD EPYC Zen 3: 3.3x
       float32's decode tokens/s at batch 1, 1.8x at batch 16, prefill ~13% slower;
       benchmarks/results/avx2-2026-11-28.md).

Where neither runs, torch converts bfloat16 to float32 inside every op and gains little
or nothing, and float16 matmuls measured several times slower than float32 even on a CPU
with AVX-512-BF16 (it has no float16 units), so half-precision checkpoints run in
bfloat16 only where that is fast. Float32 checkpoints keep float32 on CPU: their tokens
stay exactly those of float32 transformers. An explicit dtype is always used as given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.kernels import bf16_gemm_cpu
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


def choose_dtype(
    name: str,
    hf_config: dict,
    device: torch.device,
    cpuinfo: str | None = None,
    gemm_isa: Callable[[], str | None] | None = None,
) -> DtypeChoice:
    """``name`` when given; for ``auto`` see the table in this module's docstring. ``gemm_isa``
    names the variant of the engine's bf16 GEMM that runs here, None where none does
    (default :func:`bf16_gemm_cpu.isa`)."""
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
    if units:
        where = f"on a CPU with {units[0]}"
    elif (gemm_isa or bf16_gemm_cpu.isa)() == "avx2":
        where = "on a CPU with avx2 (the engine's AVX2 bfloat16 GEMM)"
    else:
        no_units = f"no {' or '.join(BF16_FLAGS)}"
        return DtypeChoice(torch.float32, f"{short} checkpoint, but the CPU has {no_units} and no AVX2 bfloat16 GEMM")
    if stored == torch.bfloat16:
        return DtypeChoice(torch.bfloat16, f"the checkpoint's {short}, {where}")
    return DtypeChoice(torch.bfloat16, f"{short} checkpoint, run in bfloat16 {where}")
