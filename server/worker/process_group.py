"""The torch.distributed group of the tensor-parallel ranks, and the layout every node must agree on."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from pagedllm.server.config import ParallelConfig


def init_group(rank: int, world_size: int, init_method: str, device_type: str) -> None:
    """Join the ranks' process group (gloo on CPU, NCCL on CUDA)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=float(os.environ.get("PAGEDLLM_TP_COLLECTIVE_TIMEOUT", "300")))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)


def layout(parallel: ParallelConfig) -> tuple[int, int]:
    """What every node must agree on: (tensor_parallel_size, nnodes)."""
    return parallel.tensor_parallel_size, parallel.nnodes
