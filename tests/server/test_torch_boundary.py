"""Torch lives in ``server/worker`` and ``kernels`` only: every module of ``server/core``,
``server/engine``, ``server/entrypoints`` and ``server/executor`` imports without it.

The probe imports each module, one by one, in a fresh interpreter where ``import torch``
fails (``sys.modules["torch"] = None``); the executor loads the worker modules, and torch
with them, only when it starts its workers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

TORCH_FREE = (
    "pagedllm.server.core",
    "pagedllm.server.engine",
    "pagedllm.server.entrypoints",
    "pagedllm.server.executor",
)

PROBE = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys, traceback
    sys.modules["torch"] = None  # any `import torch` now raises ImportError
    sys.path[:0] = json.loads(sys.argv[2])
    failed, seen = {}, []
    for package in json.loads(sys.argv[1]):
        names = [package]
        names += [m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__, package + ".")]
        for name in names:
            seen.append(name)
            try:
                importlib.import_module(name)
            except Exception as exc:
                failed[name] = "".join(traceback.format_exception_only(exc)).strip()
    print(json.dumps({"seen": seen, "failed": failed}))
    """
)


def probe(packages: tuple[str, ...], extra_path: list[str] | None = None) -> dict:
    """Import every module under ``packages`` without torch; which were seen and which failed (and why)."""
    args = [sys.executable, "-c", PROBE, json.dumps(list(packages)), json.dumps(extra_path or [])]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=300).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_engine_side_imports_without_torch():
    result = probe(TORCH_FREE)
    assert len(result["seen"]) > 50  # NOTE: the walk found the packages' modules, not just their __init__s
    assert "pagedllm.server.engine.llm_engine" in result["seen"]
    assert "pagedllm.server.entrypoints.openai.api_server" in result["seen"]
    assert result["failed"] == {}


def test_the_probe_catches_a_module_that_imports_torch_at_top_level(tmp_path: Path):
    package = tmp_path / "planted"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "clean.py").write_text("import json\n")
    (package / "inner" / "__init__.py").write_text("")
    (package / "inner" / "heavy.py").write_text("import torch\n")
    result = probe(("planted",), [str(tmp_path)])
    assert set(result["seen"]) == {"planted", "planted.clean", "planted.inner", "planted.inner.heavy"}
    assert list(result["failed"]) == ["planted.inner.heavy"]
    assert "torch" in result["failed"]["planted.inner.heavy"]
