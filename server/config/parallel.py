"""Tensor parallelism: ranks, threads, and the nodes the ranks are spread over."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pagedllm.server.config.checks import ConfigError, check_range, field_help


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field(default=1, metadata=field_help("Number of ranks the model is split over."))
    cpu_threads: int | None = field(
        default=None,
        metadata=field_help(
            "torch's intra-op threads; default: OMP_NUM_THREADS, else the CPUs the cgroup quota allows."
        ),
    )

    nnodes: int = field(
        default=1,
        metadata=field_help(
            "Hosts the tensor-parallel ranks are spread over, tensor_parallel_size / nnodes on each; "
            "node 0 runs the engine and the HTTP server, the others run `serve --headless`."
        ),
    )
    node_rank: int = field(default=0, metadata=field_help("This host's index among the nnodes (0: the engine)."))
    master_addr: str = field(
        default="127.0.0.1", metadata=field_help("Address of node 0, where the other nodes' ranks connect.")
    )
    worker_cls: str = field(
        default="auto",
        metadata=field_help(
            "The worker every rank runs, as module:Class (a subclass of the model runner, e.g. a test "
            "double); auto: the model runner."
        ),
    )
    master_port: int = field(
        default=29501,
        metadata=field_help(
            "Port on node 0 for the ranks' control channel; torch.distributed's store takes the next one."
        ),
    )

    def __post_init__(self) -> None:
        if self.worker_cls != "auto" and not re.fullmatch(r"[\w.]+:\w+", self.worker_cls):
            raise ConfigError("worker_cls", self.worker_cls, "auto or module:Class")
        check_range("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_range("cpu_threads", self.cpu_threads, 1)
        check_range("nnodes", self.nnodes, 1)
        check_range("node_rank", self.node_rank, 0, self.nnodes - 1)
        check_range("master_port", self.master_port, 1, 65534)
        if self.tensor_parallel_size % self.nnodes:
            raise ConfigError(
                "nnodes",
                self.nnodes,
                f"a divisor of tensor_parallel_size={self.tensor_parallel_size} (every node holds as many ranks)",
            )

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def node_of(self, rank: int) -> int:
        """The node that holds tensor-parallel ``rank``: ranks are dealt out in blocks, node 0 first."""
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        """``rank``'s index on its own node (its CUDA device there)."""
        return rank % self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)
