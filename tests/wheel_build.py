"""Building the wheel from exactly the files a build needs (shared by the packaging and Dockerfile tests)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What `pip wheel` / `pip install` of the project reads, and nothing else: the project
# metadata, its readme, the package layout, and the three source folders.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "server", "kernels", "operator")
# source folder -> where its files land in the wheel
PACKAGE_FOLDERS = {"server": "pagedllm/server", "kernels": "pagedllm/kernels", "operator": "pagedllm/operator"}
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")


def copy_build_inputs(dest: Path) -> Path:
    """Copy BUILD_INPUTS to ``dest`` (a fresh tree, so no stale ``build/`` of the checkout leaks in)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in BUILD_INPUTS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=IGNORED)
        else:
            shutil.copy2(source, dest / name)
    return dest


def build_wheel(workdir: Path) -> Path:
    """Build the project's wheel from a copy of BUILD_INPUTS with this interpreter's setuptools (offline)."""
    source = copy_build_inputs(workdir / "src")
    out = workdir / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
        + ["--wheel-dir", str(out), str(source)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, f"pip wheel failed:\n{built.stdout}\n{built.stderr}"
    (wheel,) = out.glob("pagedllm-*.whl")
    return wheel


def source_files(folder: str) -> list[Path]:
    """Files of a source folder, relative to the checkout, without bytecode caches."""
    return sorted(
        path.relative_to(ROOT)
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    )


def wheel_path(source: Path) -> str:
    """Where a file of a source folder lands in the wheel: server/core/x.py -> pagedllm/server/core/x.py."""
    folder, *rest = source.parts
    return "/".join([PACKAGE_FOLDERS[folder], *rest])
