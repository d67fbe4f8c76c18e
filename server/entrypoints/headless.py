"""``pagedllm serve --headless``: a node that runs only its tensor-parallel ranks, no HTTP server.

Node 0 (``--node-rank 0``, the default) runs the engine and the API; every other node of a
``--nnodes`` group runs ``serve --headless --node-rank N`` with the same
``--tensor-parallel-size``, ``--nnodes``, ``--master-addr`` and ``--master-port``. A headless
node exits when the engine says stop (0), or non-zero when the engine goes away or one of
its ranks fails, so an orchestrator restarts the group.
"""

from __future__ import annotations

import argparse
import logging

from pagedllm.server.config import ConfigError, EngineConfig


def add_headless_arg(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--headless",
        action="store_true",
        help="Run only this node's tensor-parallel ranks (needs --node-rank 1..nnodes-1): no HTTP server; "
        "node 0 serves the API.",
    )


def check_node_role(config: EngineConfig, headless: bool) -> None:
    """Node 0 serves, the others are headless: refuse any other pairing, naming the flag."""
    parallel = config.parallel
    if headless and parallel.node_rank == 0:
        raise ConfigError(
            "node_rank",
            0,
            f"--node-rank 1..{parallel.nnodes - 1} with --headless (node 0 runs the engine and the HTTP server)",
            problem="cannot be headless",
            name="--node-rank",
        )
    if not headless and parallel.node_rank > 0:
        raise ConfigError(
            "node_rank",
            parallel.node_rank,
            "add --headless: only node 0 serves HTTP",
            problem="needs --headless",
            name="--node-rank",
        )


def run_headless(config: EngineConfig, log_level: str) -> int:
    from pagedllm.server.worker.tp_rank import run_node

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parallel = config.parallel
    logging.getLogger("pagedllm.serve").info(
        "node %d of %d: ranks %s, joining the leader at %s:%d",
        parallel.node_rank,
        parallel.nnodes,
        list(parallel.ranks_of(parallel.node_rank)),
        parallel.master_addr,
        parallel.master_port,
    )
    return run_node(parallel)
