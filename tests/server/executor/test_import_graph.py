"""The executor and the workers import one way: executor -> worker, never back, and no cycle
among the worker modules, counting imports inside functions (which once hid a cycle:
model_runner -> tp_workers -> tp_rank -> model_runner).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[3] / "server"
ROOTS = {"pagedllm.server.worker": SERVER / "worker", "pagedllm.server.executor": SERVER / "executor"}
SPLIT = (
    "pagedllm.server.executor.executor",
    "pagedllm.server.worker.worker",
    "pagedllm.server.worker.model_runner",
    "pagedllm.server.worker.tp_workers",
    "pagedllm.server.worker.tp_rank",
    "pagedllm.server.worker.draft_runner",
)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> set[str]:
    """Every module imported anywhere in ``tree`` (functions included), except under ``if TYPE_CHECKING``."""
    found: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            found |= {name for child in node.orelse for name in _imports(child)}
            continue
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        found |= _imports(node)
    return found


def import_graph(roots: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules under ``roots`` it imports (at top level or lazily)."""
    modules: dict[str, Path] = {}
    for package, folder in roots.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return {
        name: {m for m in _imports(ast.parse(path.read_text())) if m in modules and m != name}
        for name, path in modules.items()
    }


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
    graph = import_graph(ROOTS)
    assert "pagedllm.server.worker.tp_rank" in graph["pagedllm.server.worker.tp_workers"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_no_worker_module_imports_the_executor():
    graph = import_graph(ROOTS)
    back = {m: sorted(d for d in deps if d.startswith("pagedllm.server.executor")) for m, deps in graph.items()}
    assert {m: deps for m, deps in back.items() if deps and m.startswith("pagedllm.server.worker")} == {}


def test_a_cycle_through_a_lazy_import_is_found(tmp_path: Path):
    (tmp_path / "a.py").write_text("import pkg.b\n")
    (tmp_path / "b.py").write_text("def later():\n    from pkg.c import x\n")
    (tmp_path / "c.py").write_text(
        "from typing import TYPE_CHECKING\nimport pkg.a\nif TYPE_CHECKING:\n    import pkg.b\n"
    )
    graph = import_graph({"pkg": tmp_path})
    assert graph["pkg.c"] == {"pkg.a"}  # NOTE: imports for type checking alone run never
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]


@pytest.mark.parametrize("module", SPLIT)
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    """Imported first, a module in a cycle would meet a half-initialised one (an ImportError)."""
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, timeout=300)
