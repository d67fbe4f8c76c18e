"""The server's layers import one way, read from the source with ``ast`` (nothing is imported).

    core  <-  engine  <-  entrypoints          worker  <-  executor  <-  engine
    config / args / sampling_params / outputs: torch-free, importable by the operator

Every ``import`` counts, also one inside a function: a lazy import is still a
dependency. Only imports under ``if TYPE_CHECKING:`` are left out.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "server"
PACKAGE = "pagedllm.server"
HEAVY = ("torch", "triton", "transformers", "fastapi", "starlette", "uvicorn", "prometheus_client", "pagedllm.kernels")
TORCH_FREE = ("core", "config", "args", "sampling_params", "outputs")
FORBIDDEN = {  # layer -> layers it must not import
    "core": ("engine", "worker", "entrypoints", "demo", "llm"),
    "worker": ("engine", "executor", "entrypoints", "llm"),
    "executor": ("core", "engine", "entrypoints", "llm"),
    "engine": ("entrypoints", "llm"),
    "config": ("core", "engine", "worker", "entrypoints", "demo", "llm"),
    "args": ("core", "engine", "worker", "entrypoints", "demo", "llm"),
}


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, module: str) -> set[str]:
    """Every module ``source`` imports at run time (relative imports resolved against ``module``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: -node.level]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def build_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    graph = {}
    for path in root.rglob("*.py"):
        name = module_name(path, root)
        graph[name] = imports_of(path.read_text(), name)
    return graph


def layer_of(module: str) -> str | None:
    rest = module[len(PACKAGE) + 1 :] if module.startswith(PACKAGE + ".") else None
    return rest.split(".")[0] if rest else None


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every import reachable from ``start`` through the package's own modules -> the module importing it."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        current = todo.pop()
        for imported in graph.get(current, ()):
            if imported not in seen:
                seen[imported] = current
                if imported in graph:
                    todo.append(imported)
    return seen


def violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module in sorted(graph):
        layer = layer_of(module)
        for imported in sorted(graph[module]):
            if layer in FORBIDDEN and layer_of(imported) in FORBIDDEN[layer]:
                found.append(f"{module} imports {imported}: {layer} must not depend on {layer_of(imported)}")
        if layer in TORCH_FREE:
            for imported, via in reachable(graph, module).items():
                if imported.split(".")[0] in HEAVY or imported.startswith(HEAVY):
                    found.append(f"{module} reaches {imported} (imported by {via}): {layer} must stay torch-free")
    return found


def test_layers_import_one_way_and_core_stays_torch_free():
    graph = build_graph()
    assert any(layer_of(m) == "core" for m in graph) and any(layer_of(m) == "engine" for m in graph)
    assert violations(graph) == []


@pytest.mark.parametrize(
    "module, bad_import, expected",
    [
        ("core/block_manager.py", "import torch", "must stay torch-free"),
        ("core/scheduler.py", "def f():\n    import torch.nn\n", "must stay torch-free"),
        ("engine/llm_engine.py", "from pagedllm.server.entrypoints.openai import serving", "engine must not depend"),
        ("core/sequence.py", "from ..engine import sampler", "core must not depend on engine"),
        ("config/cache.py", "from pagedllm.server.worker import model_loader", "must stay torch-free"),
        ("worker/tp_rank.py", "from pagedllm.server.executor import Executor", "worker must not depend on executor"),
    ],
)
def test_a_wrong_import_is_caught(tmp_path, module, bad_import, expected):
    copy = tmp_path / "server"
    for path in ROOT.rglob("*.py"):
        target = copy / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    assert violations(build_graph(copy)) == []
    target = copy / module
    target.write_text(target.read_text() + "\n" + bad_import + "\n")
    found = violations(build_graph(copy))
    assert any(expected in line for line in found), found


def test_type_checking_imports_are_not_run_time_dependencies():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\nelse:\n    import json\n"
    assert imports_of(source, "pagedllm.server.core.x") == {"typing", "typing.TYPE_CHECKING", "json"}
