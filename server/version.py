"""PagedLLM's version, as ``pagedllm --version`` prints it and the HTTP API's ``/version`` reports it."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "pagedllm"
UNKNOWN_VERSION = "0.0.0+unknown"
# NOTE: resolved, so a symlinked layout (scripts/typecheck's) still finds the checkout's root.
SOURCE_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def package_version() -> str:
    """The installed ``pagedllm`` distribution's version (wheel or editable install).

    Run from a source checkout that is not installed, the version its ``pyproject.toml``
    declares; ``0.0.0+unknown`` when neither is there.
    """
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return source_version(SOURCE_PYPROJECT) or UNKNOWN_VERSION


def source_version(pyproject: Path) -> str | None:
    """``project.version`` of ``pyproject`` when it is PagedLLM's own project file, else ``None``."""
    if sys.version_info < (3, 11) or not pyproject.is_file():
        return None  # NOTE: tomllib is 3.11+; a 3.10 checkout reports the unknown version
    import tomllib

    try:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    if project.get("name") != DISTRIBUTION or not isinstance(project.get("version"), str):
        return None
    return project["version"]
