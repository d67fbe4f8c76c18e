"""The package layout, found from the tree (the rest of the metadata is in pyproject.toml).

The three source folders are installed under one ``pagedllm`` namespace: ``server/`` as
``pagedllm.server``, ``kernels/`` as ``pagedllm.kernels``, ``operator/`` as
``pagedllm.operator``. setuptools' declarative ``packages.find`` cannot put a prefix in
front of what it finds, so the packages are listed here: every folder below the three
(a new subpackage ships without a change here; a folder of data files such as the demo
model's is a package too, as setuptools expects, and its files are package data).

NOTE: ``operator/`` has no ``__init__.py`` and must never get one (a regular package named
``operator`` on ``sys.path`` shadows the standard library's): it is a namespace package,
found like the others. tests/test_packaging.py builds the wheel and checks that every
module and every data file of the three folders is in it.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent
FOLDERS = {"pagedllm.server": "server", "pagedllm.kernels": "kernels", "pagedllm.operator": "operator"}


def packages_in(name: str, folder: str) -> list[str]:
    """``name`` and every folder below ``folder``, as dotted names under ``name``."""
    found = find_namespace_packages(ROOT / folder, exclude=["__pycache__", "*.__pycache__"])
    return [name] + [f"{name}.{sub}" for sub in sorted(found)]


setup(
    package_dir=FOLDERS,
    packages=[package for name, folder in FOLDERS.items() for package in packages_in(name, folder)],
)
