"""CPU and memory of a server pod and of its model download, derived from the model.

Host memory of a server pod (GiB, each term rounded up)::

    memory = BASE_MEMORY_GIB                          interpreter, torch, CUDA context, tokenizer
           + checkpoint GiB                           weights pass through host memory while loading
           + swapSpaceGiB x tensorParallelSize        pinned host blocks of swapped-out KV (per GPU)
           + SHM_GIB_PER_GPU x tensorParallelSize     /dev/shm (tmpfs, counted as pod memory), TP > 1 only

    cpu    = BASE_CPU + CPU_PER_GPU x tensorParallelSize

The checkpoint size is ``spec.modelSource.sizeGiB`` when given, else
``DEFAULT_CHECKPOINT_GIB`` (a 7-8B model in 16-bit precision). The memory limit equals the
request: swap space is pinned (never reclaimed), so a pod above its request is one the
kubelet would evict first under node pressure; a pod over its limit is OOM-killed with a
reason Kubernetes shows. CPU gets a request only: a CPU limit throttles the engine's step
loop and the HTTP server in bursts (tokenisation, detokenisation), raising latency for
nothing the node needs back.

``spec.resources`` overrides per resource name: a ``cpu`` or ``memory`` the spec names in
requests or limits replaces both derived values of that name (a request alone then has no
limit, a limit alone is also the request, as Kubernetes defaults it). GPUs always come
from ``tensorParallelSize``.

The ``/models`` emptyDir (no model cache) gets ``sizeLimit`` = checkpoint GiB x
``DISK_HEADROOM`` + 1 GiB (downloads write some temporary files); ``/dev/shm`` gets
``SHM_GIB_PER_GPU x tensorParallelSize``. A pod over a sizeLimit is evicted by the kubelet
with a message naming the volume, instead of filling the node's disk or memory.
"""

from __future__ import annotations

import math
from typing import Any

from pagedllm.operator.spec import PagedLLMSpec

BASE_MEMORY_GIB = 4
DEFAULT_CHECKPOINT_GIB = 16.0
SHM_GIB_PER_GPU = 2
BASE_CPU = 2
CPU_PER_GPU = 2
DISK_HEADROOM = 1.2
# The download: one process streaming files to disk (the Hub client keeps a few chunks in memory).
DOWNLOAD_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
DERIVED = ("cpu", "memory")


def checkpoint_gib(spec: PagedLLMSpec) -> float:
    """The checkpoint's size on disk, as the spec gives it or the documented default."""
    size = spec.model_source.size_gib
    return DEFAULT_CHECKPOINT_GIB if size is None else size


def shm_gib(spec: PagedLLMSpec) -> int:
    """Size of /dev/shm (tensor parallelism only: NCCL between the ranks of one pod)."""
    return SHM_GIB_PER_GPU * spec.tensor_parallel_size if spec.tensor_parallel_size > 1 else 0


def server_memory_gib(spec: PagedLLMSpec) -> int:
    swap = math.ceil(spec.swap_space_gib * spec.tensor_parallel_size)
    return BASE_MEMORY_GIB + math.ceil(checkpoint_gib(spec)) + swap + shm_gib(spec)


def server_cpu(spec: PagedLLMSpec) -> int:
    return BASE_CPU + CPU_PER_GPU * spec.tensor_parallel_size


def models_size_limit(spec: PagedLLMSpec) -> str:
    """``sizeLimit`` of the pod-local /models emptyDir the checkpoint is downloaded into."""
    return f"{math.ceil(checkpoint_gib(spec) * DISK_HEADROOM) + 1}Gi"


def server_resources(spec: PagedLLMSpec) -> dict[str, dict[str, Any]]:
    """The server container's requests and limits: derived, overridden by ``spec.resources``, GPUs."""
    memory = f"{server_memory_gib(spec)}Gi"
    derived: dict[str, dict[str, Any]] = {
        "requests": {"cpu": str(server_cpu(spec)), "memory": memory},
        "limits": {"memory": memory},
    }
    overridden = {name for part in spec.resources.values() for name in part}
    gpus = {spec.gpu_resource_name: spec.tensor_parallel_size}
    return {
        part: {
            **{name: q for name, q in derived[part].items() if name not in overridden},
            **spec.resources.get(part, {}),
            **gpus,
        }
        for part in ("requests", "limits")
    }


def download_resources() -> dict[str, dict[str, str]]:
    """The model download's requests and limits (init container or Job)."""
    return {part: dict(amounts) for part, amounts in DOWNLOAD_RESOURCES.items()}
