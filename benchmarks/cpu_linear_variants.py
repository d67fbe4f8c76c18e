"""Ways to run one CPU linear shape at decode rows, timed side by side against reading its weights.

Each variant is a callable ``run(x)`` that multiplies ``x`` [rows, in] by every weight of a
case (the copies a decode step reads: one per layer, or the single LM head) in turn:

  - ``engine``:  what the engine runs: :func:`linear` on :func:`pack_weight`'d weights, i.e.
    the bfloat16 kernel (kernels/bf16_gemm_cpu.py) where the CPU has AVX-512-BF16 or AVX2, else ``onednn``;
  - ``onednn``:  ``torch.ops.mkldnn._linear_pointwise`` on a ``torch.ops.mkldnn._reorder_linear_weight``
    copy (packed once for any row count); not for bfloat16 on a CPU where oneDNN has no bfloat16 GEMM;
  - ``packed-rows``: the same op on weights reordered for the case's row count
    (``_reorder_linear_weight(w, rows)``, as inductor's freezing does; where ``onednn`` runs);
    the engine packs once for all;
  - ``plain``:   ``F.linear`` on the plain bfloat16 weight (oneDNN matmul, weight re-blocked per call);
  - ``aten``:    ``F.linear`` on the plain weight with oneDNN switched off (aten's own gemv/gemm);
  - ``inductor``, ``inductor-autotune``, ``inductor-cpp``: ``torch.compile`` with weight freezing,
    by default, with max-autotune over ``CPP,ATEN``, and with the CPP GEMM template alone;
  - ``split-n``: (2+ threads) the packed weight cut into one column block per thread, each
    block multiplied on its own Python thread running one torch thread, the blocks concatenated.

The floor is the time of a float32-typed ``sum()`` over the very same weight bytes.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.server.worker.models.cpu_linear import can_pack, linear, onednn_bf16, pack_weight

Variant = Callable[[torch.Tensor], object]

EAGER = ("engine", "onednn", "plain", "aten")
INDUCTOR = {
    "inductor": {"freezing": True},
    "inductor-autotune": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"},
    "inductor-cpp": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"},
}
ALL = ("floor", *EAGER, "packed-rows", *INDUCTOR, "split-n")


def floor_variant(plain: list[torch.Tensor]) -> Variant:
    """Reads every weight byte once (the weights viewed as float32 and summed): the time no product can beat."""
    views = [w.view(torch.float32) if w.element_size() == 2 and w.shape[-1] % 2 == 0 else w for w in plain]
    return lambda x: [v.sum() for v in views]


def onednn_runs(plain: list[torch.Tensor]) -> bool:
    """Whether oneDNN reorders and multiplies these weights here (no bfloat16 GEMM on a CPU with AVX2 only)."""
    return all(w.dtype != torch.bfloat16 for w in plain) or onednn_bf16()


def _packed(w: torch.Tensor) -> torch.Tensor:
    """``w`` as the engine keeps it: packed where it can be, else plain."""
    return pack_weight(w) if can_pack(w) else w


def eager_variants(plain: list[torch.Tensor]) -> dict[str, Variant]:
    """The engine's packed path, oneDNN's packed path (where it runs), ``F.linear`` on the plain weight, and
    aten without oneDNN."""
    packed = [_packed(w) for w in plain]

    def aten(x: torch.Tensor) -> object:
        with torch.backends.mkldnn.flags(enabled=False):
            return [F.linear(x, w) for w in plain]

    variants: dict[str, Variant] = {"engine": lambda x: [linear(x, p) for p in packed]}
    if onednn_runs(plain):
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in plain]
        variants["onednn"] = lambda x: [linear(x, p) for p in onednn]
    variants["plain"] = lambda x: [F.linear(x, w) for w in plain]
    variants["aten"] = aten
    return variants


class _Weights(nn.Module):
    """Every weight of a case as frozen parameters, multiplied in turn (one graph for inductor)."""

    def __init__(self, plain: list[torch.Tensor]) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(w, requires_grad=False) for w in plain])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [F.linear(x, w) for w in self.weights]


def reset_compiled() -> None:
    """Forget every compiled graph (each case compiles its own; dynamo's recompile limit is per function)."""
    torch._dynamo.reset()
    gc.collect()


def inductor_variant(plain: list[torch.Tensor], x: torch.Tensor, options: dict) -> Variant:
    """``torch.compile`` of the case under inductor ``options``, compiled now for ``x``'s shape."""
    import torch._inductor.config as inductor_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    compiled = torch.compile(_Weights(plain).eval(), dynamic=False)
    with inductor_config.patch(options), torch.no_grad(), contextlib.redirect_stdout(None):
        compiled(x)

    def run(x: torch.Tensor) -> object:
        with torch.no_grad():
            return compiled(x)

    return run


class SplitN:
    """The packed weights cut into ``threads`` column blocks, each block on a thread of its own (one torch thread each).

    NOTE: torch.set_num_threads in a pool thread sets that thread's OpenMP team size; the
    calling thread keeps its own.
    """

    def __init__(self, plain: list[torch.Tensor], threads: int) -> None:
        self.pool = ThreadPoolExecutor(threads, initializer=torch.set_num_threads, initargs=(1,))
        self.blocks = [[_packed(b.contiguous()) for b in w.tensor_split(threads, dim=0)] for w in plain]

    def __call__(self, x: torch.Tensor) -> object:
        out = []
        for blocks in self.blocks:
            parts = [self.pool.submit(linear, x, b) for b in blocks]
            out.append(torch.cat([p.result() for p in parts], dim=-1))
        return out

    def close(self) -> None:
        self.pool.shutdown()


def static_variants(plain: list[torch.Tensor], threads: int, names: tuple[str, ...]) -> dict[str, Variant]:
    """The floor and the variants in ``names`` that need no compiling (``split-n`` only at two threads or more)."""
    variants: dict[str, Variant] = {"floor": floor_variant(plain)}
    variants.update({k: v for k, v in eager_variants(plain).items() if k in names})
    if "split-n" in names and threads > 1:
        variants["split-n"] = SplitN(plain, threads)
    return variants


def row_variants(plain: list[torch.Tensor], x: torch.Tensor, names: tuple[str, ...]) -> dict[str, Variant]:
    """The variants in ``names`` made for ``x``'s row count: ``packed-rows`` and inductor's, compiled now."""
    variants: dict[str, Variant] = {}
    if "packed-rows" in names and onednn_runs(plain):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0]) for w in plain]
        variants["packed-rows"] = lambda x: [linear(x, p) for p in packed]
    variants.update({name: inductor_variant(plain, x, opts) for name, opts in INDUCTOR.items() if name in names})
    return variants
