"""Checks and resources that tests of every package share (import as ``tests.support``).

Nothing here imports the engine or torch: the operator's tests use it too.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any


def free_port(consecutive: int = 1) -> int:
    """A TCP port P on 127.0.0.1 that is free now, with P+1 .. P+consecutive-1 free too.

    NOTE: free when asked, not reserved: another process may take it before the caller binds.
    """
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if all(_is_free(port + i) for i in range(1, consecutive)):
            return port
    raise RuntimeError(f"no {consecutive} consecutive free ports")


def _is_free(port: int) -> bool:
    if port > 65535:
        return False
    with contextlib.suppress(OSError), socket.socket() as s:
        s.bind(("127.0.0.1", port))
        return True
    return False


def assert_all_blocks_free(llm: Any) -> None:
    """Nothing is left of any request in an engine (or an ``LLM``'s engine) that has finished them all.

    No request is unfinished, running, waiting or swapped; every device and host block is
    free (or evictable), no sequence has a block table, the reference counts agree with the
    tables, no LoRA adapter is held by a request, and the engine keeps no request state.
    """
    engine = getattr(llm, "llm_engine", llm)
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
    assert stats.running_lora_adapters == ()
    bm = engine.block_manager
    assert not bm.tables
    assert bm.check_invariants() == []
    assert engine._requests == {}
