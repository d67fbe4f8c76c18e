"""The executor and the workers import one way: executor -> worker, never back, and no cycle
among the worker modules, counting imports inside functions (which once hid a cycle:
model_runner -> tp_workers -> tp_rank -> model_runner).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_layers import build_graph

SPLIT_PACKAGES = ("pagedllm.server.worker", "pagedllm.server.executor")
SPLIT = (
    "pagedllm.server.executor.executor",
    "pagedllm.server.worker.worker",
    "pagedllm.server.worker.model_runner",
    "pagedllm.server.worker.tp_workers",
    "pagedllm.server.worker.tp_rank",
    "pagedllm.server.worker.draft_runner",
)


def import_graph(root: Path | None = None, packages: tuple[str, ...] = SPLIT_PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports, at top level or lazily (``test_layers``' reading)."""
    full = build_graph(root) if root is not None else build_graph()
    inside = {m for m in full if m.startswith(packages)}
    return {m: {d for d in full[m] if d in inside and d != m} for m in inside}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_worker_and_executor_modules_import_without_a_cycle():
    graph = import_graph()
    assert "pagedllm.server.worker.tp_rank" in graph["pagedllm.server.worker.tp_workers"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_no_worker_module_imports_the_executor():
    graph = import_graph()
    back = {m: sorted(d for d in deps if d.startswith("pagedllm.server.executor")) for m, deps in graph.items()}
    assert {m: deps for m, deps in back.items() if deps and m.startswith("pagedllm.server.worker")} == {}


def test_a_cycle_through_a_lazy_import_is_found(tmp_path: Path):
    worker = tmp_path / "worker"
    worker.mkdir()
    (worker / "a.py").write_text("import pagedllm.server.worker.b\n")
    (worker / "b.py").write_text("def later():\n    from pagedllm.server.worker.c import x\n")
    (worker / "c.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import a\nif TYPE_CHECKING:\n    import pagedllm.server.worker.b\n"
    )
    graph = import_graph(tmp_path)
    assert graph["pagedllm.server.worker.c"] == {"pagedllm.server.worker.a"}  # NOTE: type-checking imports never run
    cycle = find_cycle(graph)
    assert cycle is not None and [m.rsplit(".", 1)[1] for m in cycle] == ["a", "b", "c", "a"]


@pytest.mark.parametrize("module", SPLIT)
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    """Imported first, a module in a cycle would meet a half-initialised one (an ImportError)."""
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, timeout=300)
